"""The search tree a result carries on request, and its drawing."""

import dataclasses

from sgl_tts.app.tree_plot import layout, plot_tree
from sgl_tts.problems import Problem
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.search.programs import load_program
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

SEARCH = SearchConfig(n=4, beam_width=2, max_steps=4, max_step_tokens=48, max_tokens=192, record_tree=True)


def beam_search(config):
    runtimes = Runtimes(generator=ScriptedBackend(ScriptedModel(answer_depth=2, answer_chance=0.4)),
                        scorer=ScriptedScorer(), prompt=lambda q: "Q: 2+2?\n\n")
    return load_program("beam_search")(Problem(id="t", question="2+2?", gold="4"), config, runtimes)


def test_the_tree_holds_every_scored_step_and_marks_the_ends(tmp_path):
    result = beam_search(SEARCH)
    nodes = result.extra["tree"]["nodes"]
    by_id = {node["id"]: node for node in nodes}
    assert len([n for n in nodes if n["depth"] == 1]) == SEARCH.n, "the first iteration's n children"
    for node in nodes:
        assert node["parent"] is None if node["depth"] == 1 else by_id[node["parent"]]["depth"] == node["depth"] - 1
        assert node["score"] is not None and 0 <= node["score"] <= 1
    ended = [n for n in nodes if "end" in n]
    assert len(ended) == len(result.candidates)
    assert any(n["selected"] for n in ended) == (result.answer is not None)
    # a candidate's steps are the chain of step texts from its node to the root
    for candidate in result.candidates:
        node = next(n for n in ended if n["step"] == candidate.steps[-1] and n["depth"] == len(candidate.steps))
        chain = []
        while node is not None:
            chain.append(node["step"])
            node = by_id.get(node["parent"])
        assert chain[::-1] == candidate.steps
    png = plot_tree(result.extra["tree"], tmp_path / "tree.png", "beam search")
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_no_tree_unless_asked_and_the_layout_centres_parents():
    assert "tree" not in beam_search(dataclasses.replace(SEARCH, record_tree=False)).extra
    nodes = [{"id": 0, "parent": None}, {"id": 1, "parent": 0}, {"id": 2, "parent": 0}, {"id": 3, "parent": 2}]
    positions = layout(nodes)
    assert positions[1] == (2.0, 0.0) and positions[3] == (3.0, 1.0) and positions[0] == (1.0, 0.5)
