"""Search programs by name.

A program is a module with `run(problem, config, runtimes) -> SearchResult`, or a plain SGLang program: a
module whose one `@sgl.function` (or the one named `program`) is run by `run_plain_program`. Every module
in the `programs/` package is a program named after its file; a config may also name any importable module
(`package.module`) or a file path (`path/to/my_search.py`). The `programs` package is found by name, not
imported here: it is the layer above this one.

A caller that hands the loaded program a search's context (`Session.solve`, `sgl-tts serve`, `sgl-tts eval`)
owns that search: the program runs bound to it (`SearchContext.running`), so every request a state made in its
thread sends belongs to that search, a context the program makes itself there included (it runs inside the
caller's, `sgl_tts.search.context`), and the result carries the search's token counts. A program whose result
counts tokens the search never saw (states made on threads of its own) fails with `UnaccountedProgram`.

A program module may also declare `Settings`, a frozen dataclass of its own settings (the run config's
`search.settings:` mapping, validated against it here; the program reads the instance as `config.settings`),
and `RUNTIMES`, the runtimes it needs besides the generator (names from `RUNTIME_NAMES`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from sgl_tts.config import ConfigError, load_dataclass

PROGRAMS_PACKAGE = "programs"
RUNTIME_NAMES = ("scorer", "target")  # what a program may need besides the generator: `Runtimes` fields

ProgramFn = Callable[..., object]


class UnaccountedProgram(ConfigError):
    """A program's result counts generated tokens that the search it ran in never saw."""


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


def program_module(name: str) -> ModuleType:
    """The module of program `name`; an unknown name lists the known ones."""
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
    return module


def load_program(name: str) -> ProgramFn:
    """Program `name` as `run(problem, config, runtimes, context=None, **arguments)`, run bound to `context` when
    one is given (the module docstring); an unknown name lists the known ones."""
    module = program_module(name)
    run = getattr(module, "run", None)
    if callable(run):
        if "context" not in inspect.signature(run).parameters:  # run(problem, config, runtimes): no context to pass
            run = functools.partial(_without_context, run)
        return functools.partial(_run_in_search, run, name)
    function = plain_function(module)
    if function is None:
        raise KeyError(f"program {name!r} ({module.__name__}) has no run(problem, config, runtimes) function and "
                       f"no single @sgl.function")
    from sgl_tts.search.api import run_plain_program

    label = Path(name).stem if name.endswith(".py") else name
    return functools.partial(_run_in_search, functools.partial(_run_plain, run_plain_program, function, label), name)


def _run_plain(runner: Callable[..., object], function: object, name: str, problem: object, config: object,
               runtimes: object, context: object = None) -> object:
    return runner(function, problem, name, config, runtimes, context)


def _without_context(run: Callable[..., object], problem: object, config: object, runtimes: object,
                     context: object = None, **arguments: object) -> object:
    return run(problem, config, runtimes, **arguments)


def _run_in_search(run: Callable[..., Any], name: str, problem: object, config: object, runtimes: object,
                   context: Any = None, **arguments: object) -> Any:
    """`run` with the search `context` bound around it and its result given the search's counts (`accounted`);
    without a context the program starts its own search, unless the config has a budget or a stopping rule (then
    the search is started here, so that its early stop is answered here). A search that stops early
    (SearchStopped, `sgl_tts.search.context`) answers with the paths it has seen (`stopped_result`)."""
    from sgl_tts.search.api import stopped_result
    from sgl_tts.search.context import SearchStopped

    if context is None and not config.may_stop_early:
        return run(problem, config, runtimes, **arguments)
    if context is None:
        context = runtimes.new_search(config, problem.id)
    try:
        try:
            with context.running():
                result = run(problem, config, runtimes, context, **arguments)
        except SearchStopped as stop:
            result = stopped_result(problem.id, name, config, context, stop.reason)
        finally:
            context.close()
        return accounted(result, context, name)
    finally:
        context.release_paths()


def accounted(result: Any, context: Any, name: str) -> Any:
    """`result` (a `SearchResult`) with the token counts of the search `context` it ran in: every request sent
    there, counted from the server's meta_info (or the search's hand counts), whatever the program counted itself.
    Raises `UnaccountedProgram`, naming program `name`, when the result counts generated tokens the search never
    saw (on its whole or on one candidate)."""
    claimed = max([result.generated_tokens, *(candidate.tokens for candidate in result.candidates)])
    seen = context.generated_tokens
    if claimed > seen:
        raise UnaccountedProgram(
            f"program {name!r} sent requests its search never saw (its result counts {claimed} generated tokens, "
            f"the search {seen}): it makes program states outside the search, on a thread of its own. Take the "
            f"search's context, def run(problem, config, runtimes, context=None), and make the states where it "
            f"is bound: in the thread run is called in, or inside `with context.running():` (docs/writing-programs.md)")
    extra = {**result.extra, "timeline": context.timeline()} if context.ledger.record_windows else result.extra
    return dataclasses.replace(result, generated_tokens=seen, prompt_tokens=context.prompt_tokens,
                               cached_tokens=context.cached_tokens, extra=extra)


def plain_function(module: ModuleType) -> object | None:
    """The module's `@sgl.function` named `program`, or its only one; None when there is none or several."""
    from sglang.lang.ir import SglFunction

    functions = {name: value for name, value in vars(module).items()
                 if isinstance(value, SglFunction) and getattr(value.func, "__module__", None) == module.__name__}
    if "program" in functions:
        return functions["program"]
    return next(iter(functions.values())) if len(functions) == 1 else None


def program_settings(name: str, settings: Any, where: str = "<config>", key: str = "search.settings") -> Any:
    """Program `name`'s own settings: its `Settings` dataclass built from `settings` (a mapping, as in YAML, an
    instance, or None for the defaults), with the config loader's errors naming `key.<field>` and `where`.
    A program without `Settings` takes none: None, or a ConfigError."""
    settings_class = getattr(program_module(name), "Settings", None)
    if settings_class is None:
        if settings is None or settings == {}:
            return None
        raise ConfigError(f"{where}: program {name!r} takes no settings, got '{key}': {settings!r}")
    if type(settings) is settings_class:
        return settings
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        settings = dataclasses.asdict(settings)  # another load of the same file, or another program's settings
    return load_dataclass(settings_class, settings, where, prefix=key + ".")


def with_program_settings(search: Any, where: str = "<config>", key: str = "search.settings") -> Any:
    """The search config `search` with its `settings` made its program's (`program_settings`)."""
    return dataclasses.replace(search, settings=program_settings(search.program, search.settings, where, key))


def program_runtimes(name: str) -> tuple[str, ...]:
    """The runtimes program `name` needs besides the generator (its `RUNTIMES`), each a `Runtimes` field."""
    needed = tuple(getattr(program_module(name), "RUNTIMES", ()))
    unknown = [runtime for runtime in needed if runtime not in RUNTIME_NAMES]
    if unknown:
        raise KeyError(f"program {name!r} declares unknown runtime {unknown[0]!r} in RUNTIMES; "
                       f"known: {', '.join(RUNTIME_NAMES)}")
    return needed


def program_decoded_paths(name: str, config: Any, concurrency: int) -> int | None:
    """Sequences one step of `concurrency` searches of program `name` decodes at once, when the program says
    (`decoded_paths(config, concurrency)`); None for the default of the memory plan (config.n)."""
    decoded_paths = getattr(program_module(name), "decoded_paths", None)
    return decoded_paths(config, concurrency) if decoded_paths is not None else None


def program_summary(name: str) -> str:
    """First line of the program module's docstring."""
    module = importlib.import_module(f"{PROGRAMS_PACKAGE}.{name}")
    return (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
