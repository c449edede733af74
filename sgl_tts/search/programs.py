"""Search programs by name.

A program is a module with `run(problem, config, runtimes) -> SearchResult`, or a plain SGLang program: a
module whose one `@sgl.function` (or the one named `program`) is run by `run_plain_program`. Every module
in the `programs/` package is a program named after its file; a config may also name any importable module
(`package.module`) or a file path (`path/to/my_search.py`). The `programs` package is found by name, not
imported here: it is the layer above this one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

PROGRAMS_PACKAGE = "programs"

ProgramFn = Callable[..., object]


def program_names() -> list[str]:
    """The programs found in the `programs/` package, by name."""
    package = sys.modules.get(PROGRAMS_PACKAGE)  # its __path__ may have been extended
    if package is not None:
        locations = list(package.__path__)
    else:
        spec = importlib.util.find_spec(PROGRAMS_PACKAGE)
        assert spec is not None and spec.submodule_search_locations, f"the {PROGRAMS_PACKAGE!r} package is missing"
        locations = list(spec.submodule_search_locations)
    return sorted(m.name for m in pkgutil.iter_modules(locations) if not m.name.startswith("_"))


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
        module = importlib.import_module(f"{PROGRAMS_PACKAGE}.{name}")
    elif "." in name:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            raise KeyError(f"program module {name!r} cannot be imported") from None
    else:
        raise KeyError(f"unknown program {name!r}; known programs: {', '.join(program_names())}")
    run = getattr(module, "run", None)
    if callable(run):
        return run
    function = plain_function(module)
    if function is None:
        raise KeyError(f"program {name!r} ({module.__name__}) has no run(problem, config, runtimes) function and "
                       f"no single @sgl.function")
    from sgl_tts.search.api import run_plain_program

    return functools.partial(_run_plain, run_plain_program, function, Path(name).stem if name.endswith(".py") else name)


def _run_plain(runner: Callable[..., object], function: object, name: str, problem: object, config: object,
               runtimes: object) -> object:
    return runner(function, problem, name, config, runtimes)


def plain_function(module: ModuleType) -> object | None:
    """The module's `@sgl.function` named `program`, or its only one; None when there is none or several."""
    from sglang.lang.ir import SglFunction

    functions = {name: value for name, value in vars(module).items()
                 if isinstance(value, SglFunction) and getattr(value.func, "__module__", None) == module.__name__}
    if "program" in functions:
        return functions["program"]
    return next(iter(functions.values())) if len(functions) == 1 else None


def program_summary(name: str) -> str:
    """First line of the program module's docstring."""
    module = importlib.import_module(f"{PROGRAMS_PACKAGE}.{name}")
    return (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
