import pytest

from sgl_tts.problems import Problem
from sgl_tts.search.programs import load_program, program_names
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.testing import ScriptedBackend, ScriptedScorer


def test_builtin_programs_are_registered():
    assert {"best_of_n", "beam_search", "deepconf", "self_consistency"} <= set(program_names())


def test_unknown_program_lists_known_names():
    with pytest.raises(KeyError) as info:
        load_program("monte_carlo")
    assert "beam_search" in str(info.value) and "best_of_n" in str(info.value)


def test_user_program_file_is_loaded_and_runs(tmp_path):
    from test_search_accounting import OWN_STATE_EXPANDED  # a user's program: its own state, one path by expand

    source = OWN_STATE_EXPANDED
    path = tmp_path / "greedy_chain.py"
    path.write_text(source)
    run = load_program(str(path))
    result = run(Problem("q", "1+1?", "2"), SearchConfig(n=1, max_steps=5, max_tokens=1000),
                 Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(), prompt=lambda q: q + "\n\n"))
    assert result.program == "own_state_expanded"
    assert len(result.candidates) == 1 and 1 <= len(result.candidates[0].steps) <= 5


def test_a_program_declares_its_settings_and_runtimes(tmp_path):
    from sgl_tts.config import ConfigError
    from sgl_tts.search.programs import program_runtimes, program_settings, with_program_settings

    path = tmp_path / "repeat.py"
    path.write_text('''
from dataclasses import dataclass

RUNTIMES = ("target",)


@dataclass(frozen=True)
class Settings:
    times: int = 2
    word: str = "hi"

    def __post_init__(self):
        if self.times < 1:
            raise ValueError(f"times must be at least 1, got {self.times}")


def run(problem, config, runtimes, context=None):
    return config.settings.word * config.settings.times
''')
    name = str(path)
    assert program_runtimes(name) == ("target",) and program_runtimes("beam_search") == ()
    settings = program_settings(name, {"times": 3}, "run.yaml")
    assert (settings.times, settings.word) == (3, "hi")
    search = with_program_settings(SearchConfig(program=name, settings={"word": "ab"}), "run.yaml")
    assert load_program(name)(Problem("q", "?", None), search, None) == "abab"
    again = program_settings(name, settings, "run.yaml")  # an instance of an earlier load of the same file
    assert (type(again).__name__, again.times) == ("Settings", 3)
    assert (program_settings(name, None).times, program_settings(name, None).word) == (2, "hi"), "None: defaults"
    with pytest.raises(ConfigError, match=r"run\.yaml: unknown key 'search\.settings\.time'; known keys here: times"):
        program_settings(name, {"time": 3}, "run.yaml")
    with pytest.raises(ConfigError, match=r"run\.yaml: 'search\.settings\.times' must be int, got 'x'"):
        program_settings(name, {"times": "x"}, "run.yaml")
    with pytest.raises(ConfigError, match=r"run\.yaml: search\.settings: times must be at least 1, got 0"):
        program_settings(name, {"times": 0}, "run.yaml")
    with pytest.raises(ConfigError, match=r"run\.yaml: program 'dvts' takes no settings"):
        program_settings("dvts", {"times": 3}, "run.yaml")
    assert program_settings("dvts", None) is None and program_settings("dvts", {}) is None
    path.write_text('RUNTIMES = ("verifier",)\n\ndef run(problem, config, runtimes, context=None):\n    return None\n')
    with pytest.raises(KeyError, match="unknown runtime 'verifier' in RUNTIMES; known: scorer, target"):
        program_runtimes(name)


def test_a_registry_names_what_it_knows():
    import pytest

    from sgl_tts.registry import Registry

    colours = Registry("colour", {"red": 1})
    colours.register("blue")(2)
    assert colours["blue"] == 2 and list(colours) == ["red", "blue"] and "red" in colours and len(colours) == 2
    with pytest.raises(KeyError, match="unknown colour 'green'; known: red, blue"):
        colours["green"]
    with pytest.raises(ValueError, match="unknown colour 'green'; known: red, blue"):
        colours.check("green")
    with pytest.raises(ValueError, match="registered twice"):
        colours.add("red", 3)


def test_the_earlier_names_of_the_search_api_still_work_with_a_deprecation_warning():
    import sgl_tts.search as search
    from sgl_tts.search.api import ReasoningPath
    from sgl_tts.search.context import SearchContext

    for old, new in (("Path", ReasoningPath), ("SearchTracker", SearchContext)):
        with pytest.warns(DeprecationWarning, match=f"sgl_tts.search.{old} is now {new.__name__}"):
            assert getattr(search, old) is new
