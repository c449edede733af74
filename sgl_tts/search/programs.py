"""Search programs by name.

A program is a module with `run(problem, config, runtimes) -> SearchResult`. Every module in the
`programs/` package is one, named after its file; a config may also name any importable module
(`package.module`) or a file path (`path/to/my_search.py`).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Callable

import programs

ProgramFn = Callable[..., object]


def program_names() -> list[str]:
    """The programs found in the `programs/` package, by name."""
    return sorted(m.name for m in pkgutil.iter_modules(programs.__path__) if not m.name.startswith("_"))


def _load_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"sgl_tts_user_program_{path.stem}", path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_program(name: str) -> ProgramFn:
    """The `run` function of program `name`; an unknown name lists the known ones."""
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise KeyError(f"program file {name} not found")
        module = _load_file(path)
    elif name in program_names():
        module = importlib.import_module(f"programs.{name}")
    elif "." in name:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            raise KeyError(f"program module {name!r} cannot be imported") from None
    else:
        raise KeyError(f"unknown program {name!r}; known programs: {', '.join(program_names())}")
    run = getattr(module, "run", None)
    if not callable(run):
        raise KeyError(f"program {name!r} ({module.__name__}) has no run(problem, config, runtimes) function")
    return run


def program_summary(name: str) -> str:
    """First line of the program module's docstring."""
    module = importlib.import_module(f"programs.{name}")
    return (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
