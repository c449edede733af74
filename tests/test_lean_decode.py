"""The lean decode step (policies/lean_decode.py) against SGLang's own layer code on the same kernels: the same
tokens, logprobs and probe margins from a batch of sequences of different lengths (their prompts' extends and the
margins' reads through the lean loop too), and what it leaves to SGLang."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.models.llama")

from policies import lean_decode  # noqa: E402

PROMPTS = [[1, 2, 3], list(range(5, 40)), [7] * 60, list(range(100, 190))]  # one decode batch of four lengths


def decode_all(url: str, prompt_ids: list[list[int]]) -> list[dict]:
    """Greedy decodes of every prompt, sent together so that the runtime decodes them as one batch."""
    from sgl_tts.runtime.server import http_json

    def decode(ids):
        return http_json(url + "/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}})

    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        return list(pool.map(decode, prompt_ids))


def margins_of(url: str, ids: list[int]) -> list[float]:
    """The probe margins of `ids`, most of them read from the KV slots their decode wrote."""
    from policies.probe_readout import META_KEY
    from sgl_tts.runtime.server import http_json

    answer = http_json(url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert answer["meta_info"]["cached_tokens"] >= len(ids) - 2, "the decoded tokens' slots were cached"
    return answer["meta_info"][META_KEY][0]


@pytest.mark.runtime
def test_the_lean_step_decodes_and_records_margins_as_sglangs_layers_do(tiny_runtime, tiny_probe_head, tmp_path):
    """The shared tiny runtime decodes with the lean step (the CPU default); a second one with SGLang's layer code.
    Both have the probe head, whose capture the lean step calls at the head's layer."""
    from sgl_tts import env_names
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    config = RuntimeConfig(model="tiny-random", max_total_tokens=4096,
                           env={env_names.CPU_DECODE: "sglang", env_names.PROBE_HEAD: str(tiny_probe_head)})
    with Runtime.start(config, name="tiny-sglang-decode", log_dir=tmp_path) as sglang_runtime:
        expected = decode_all(sglang_runtime.url, PROMPTS)
        expected_margins = [margins_of(sglang_runtime.url, ids + answer["output_ids"])
                            for ids, answer in zip(PROMPTS, expected)]
        assert "lean decode" not in sglang_runtime.log_path.read_text()
    got = decode_all(tiny_runtime.url, PROMPTS)
    log = tiny_runtime.log_path.read_text()
    assert "lean decode took a step (2 layers)" in log
    assert "lean decode took an extend (2 layers)" in log  # the prompts, and the margins' reads below
    for ids, answer, reference, reference_margins in zip(PROMPTS, got, expected, expected_margins):
        assert answer["output_ids"] == reference["output_ids"]
        logprobs = torch.tensor([logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]])
        reference_logprobs = torch.tensor([lp for lp, _, _ in reference["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(logprobs, reference_logprobs, rtol=0, atol=1e-5)
        margins = margins_of(tiny_runtime.url, ids + answer["output_ids"])
        torch.testing.assert_close(torch.tensor(margins), torch.tensor(reference_margins), rtol=0, atol=1e-5)


@pytest.mark.runtime
def test_the_compiled_step_decodes_and_records_margins_as_the_python_loop_does(tiny_grid_model, tiny_probe_head,
                                                                                tmp_path):
    """The tiny model on its grids, with the probe head, served twice with its products read from the grids: the
    compiled step (policies/decode_step.cpp, the default) and the same loop in Python ($SGLTTS_CPU_DECODE=
    lean-python), decode steps and extends (the prompts, the margins' reads) alike. The same kernels on the same
    inputs in the same order: one sequence at a time, the same tokens with the same logprobs to the bit; a batch of
    sequences of different lengths, the same tokens, and logprobs to fp32's precision (the requests join the batch
    at steps that vary from run to run, and the fp32 head sums a row in an order that depends on the rows beside
    it). The compiled step calls the head's capture at its layer: the same margins."""
    from sgl_tts import env_names
    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    folder, _ = tiny_grid_model
    alone, batched, margins, logs = {}, {}, {}, {}
    for decode in (lean_decode.LEAN, lean_decode.LEAN_PYTHON):
        config = RuntimeConfig(model=str(folder), max_total_tokens=4096,
                               env={env_names.CPU_LINEAR: "packed-int4", env_names.CPU_DECODE: decode,
                                    env_names.PROBE_HEAD: str(tiny_probe_head)})
        with Runtime.start(config, name=f"tiny-{decode}", log_dir=tmp_path) as runtime:
            alone[decode] = [decode_all(runtime.url, [ids])[0] for ids in PROMPTS]
            batched[decode] = decode_all(runtime.url, PROMPTS)
            margins[decode] = [margins_of(runtime.url, ids + answer["output_ids"])
                               for ids, answer in zip(PROMPTS, batched[decode])]
            logs[decode] = runtime.log_path.read_text()
    assert "lean decode took a compiled step (2 layers)" in logs[lean_decode.LEAN]
    assert "lean decode took a compiled extend (2 layers)" in logs[lean_decode.LEAN]  # prompts and margins' reads
    assert "took a compiled" not in logs[lean_decode.LEAN_PYTHON]
    assert "lean decode took a step (2 layers)" in logs[lean_decode.LEAN_PYTHON]
    assert "lean decode took an extend (2 layers)" in logs[lean_decode.LEAN_PYTHON]
    for compiled, python in zip(alone[lean_decode.LEAN], alone[lean_decode.LEAN_PYTHON]):
        assert compiled["output_ids"] == python["output_ids"]
        assert compiled["meta_info"]["output_token_logprobs"] == python["meta_info"]["output_token_logprobs"]
    for compiled, python in zip(batched[lean_decode.LEAN], batched[lean_decode.LEAN_PYTHON]):
        assert compiled["output_ids"] == python["output_ids"]
        logprobs = [torch.tensor([logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]])
                    for answer in (compiled, python)]
        torch.testing.assert_close(*logprobs, rtol=1e-5, atol=0)
    for compiled, python in zip(margins[lean_decode.LEAN], margins[lean_decode.LEAN_PYTHON]):
        assert len(compiled) > 16  # the prompt's and the decoded tokens' margins
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(python), rtol=0, atol=1e-5)


def a_layer(**attributes):
    return SimpleNamespace(**attributes)


def test_a_layer_wrapped_without_a_capture_sends_the_step_to_sglang():
    """A layer whose forward some hook replaced is computed by that forward: the lean step takes the model only
    when every such layer left the capture the lean step calls instead."""
    plain = a_layer()
    captured = a_layer(forward=lambda *args: None)
    setattr(captured, lean_decode.CAPTURE, lambda residual, batch: None)
    assert lean_decode.captures(SimpleNamespace(layers=[plain, captured])) == [None, getattr(captured,
                                                                                             lean_decode.CAPTURE)]
    wrapped = a_layer(forward=lambda *args: None)
    assert lean_decode.captures(SimpleNamespace(layers=[plain, wrapped])) is None


def test_a_model_that_is_not_a_plain_llama_is_named_and_left_to_sglang():
    """Another model class, or a Llama whose pieces the kernels do not compute, goes to SGLang's forward, and the
    reason is the one a runtime's log shows."""
    assert lean_decode.refusal(SimpleNamespace()) == "a SimpleNamespace, not a LlamaModel"
    calls = []
    hook = lean_decode.make_forward_hook(bf16=False, announce=calls.append)
    model = SimpleNamespace(layers_to_capture=[])
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True))
    out = hook(lambda *args: "sglang", model, torch.tensor([1]), torch.tensor([0]), batch)
    assert out == "sglang"
    assert calls == ["lean decode not taken: a SimpleNamespace, not a LlamaModel"]
    hook(lambda *args: "sglang", model, torch.tensor([1]), torch.tensor([0]), batch)
    assert len(calls) == 1, "said once per process"


def test_the_compiled_step_knows_when_a_weight_it_was_built_from_changed():
    """`DecodeStep.current`: the step keeps each projection's weight (storage and version) and says when one was
    replaced or changed in place, so that `compiled_step` builds it again from the new grids."""
    from policies import cpu_linear

    kernel = lean_decode.step_kernel()
    if kernel is None:
        pytest.skip("no compiler for the compiled step")
    hidden, head_dim, q_heads, kv_heads, mlp = 64, 32, 2, 1, 64
    shapes = [((q_heads + 2 * kv_heads) * head_dim, hidden), (hidden, q_heads * head_dim), (2 * mlp, hidden),
              (hidden, mlp)]
    weights = [cpu_linear.q4_1_round(torch.randn(rows, columns) * 0.05) for rows, columns in shapes]
    tiles = [cpu_linear.grid_tiles(weight) for weight in weights]
    step = kernel.DecodeStep(torch.ones(hidden), 1e-5)
    step.add_layer(torch.ones(hidden), 1e-5, torch.ones(hidden), 1e-5, [p for p, _ in tiles], [s for _, s in tiles],
                   [None] * 4, False, weights, torch.zeros(16, head_dim), head_dim, True,
                   torch.zeros(8, kv_heads, head_dim), torch.zeros(8, kv_heads, head_dim), q_heads, kv_heads,
                   head_dim, head_dim ** -0.5)
    assert step.current()
    weights[2].mul_(1.0)  # changed in place: a new version
    assert not step.current()
    short = cpu_linear.grid_tiles(cpu_linear.q4_1_round(torch.randn(q_heads * head_dim, hidden)))  # no k, v rows
    with pytest.raises(RuntimeError, match="qkv"):  # the shapes are checked when a layer is added
        step.add_layer(torch.ones(hidden), 1e-5, torch.ones(hidden), 1e-5, [short[0]] + [p for p, _ in tiles[1:]],
                       [short[1]] + [s for _, s in tiles[1:]], [None] * 4, False, weights,
                       torch.zeros(16, head_dim), head_dim, True, torch.zeros(8, kv_heads, head_dim),
                       torch.zeros(8, kv_heads, head_dim), q_heads, kv_heads, head_dim, head_dim ** -0.5)


HIDDEN, HEAD_DIM, Q_HEADS, KV_HEADS, MLP = 64, 32, 2, 1, 64  # the one-layer steps below


def one_layer_grids(seed: int) -> tuple[list, list]:
    """(weights, their grid tiles): a layer's four projections of the shapes above, random and put on Q4_1 grids."""
    from policies import cpu_linear

    generator = torch.Generator().manual_seed(seed)
    shapes = [((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, Q_HEADS * HEAD_DIM), (2 * MLP, HIDDEN),
              (HIDDEN, MLP)]
    weights = [cpu_linear.q4_1_round(torch.randn(n, k, generator=generator) * 0.2) for n, k in shapes]
    return weights, [cpu_linear.grid_tiles(weight) for weight in weights]


def one_layer_step(kernel, weights, tiles, rotary, slots: int, amx: bool = False):
    """(a one-layer DecodeStep of those weights, unit norms, its (k_cache, v_cache) of `slots` slots)."""
    step = kernel.DecodeStep(torch.ones(HIDDEN), 1e-5)
    caches = torch.zeros(slots, KV_HEADS, HEAD_DIM), torch.zeros(slots, KV_HEADS, HEAD_DIM)
    step.add_layer(torch.ones(HIDDEN), 1e-5, torch.ones(HIDDEN), 1e-5, [p for p, _ in tiles], [s for _, s in tiles],
                   [None] * 4, amx, weights, rotary, HEAD_DIM, True, *caches, Q_HEADS, KV_HEADS, HEAD_DIM,
                   HEAD_DIM ** -0.5)
    return step, caches


def test_a_compiled_extend_is_its_tokens_decoded_one_at_a_time():
    """A one-layer step fed two sequences' new tokens as one extend (3 after a cached prefix of 2, and 4 from
    nothing) writes the same keys and values and returns the same rows as the same tokens decoded one step at a
    time (each attending to the tokens before it), to fp32's precision; and an extend length that does not add up to
    the rows is refused."""
    from policies import cpu_linear

    kernel = lean_decode.step_kernel()
    if kernel is None or cpu_linear.grid_kernels() is None:
        pytest.skip("no compiled step on this machine")
    weights, tiles = one_layer_grids(11)
    generator = torch.Generator().manual_seed(12)
    angles = torch.rand(8, HEAD_DIM // 2, generator=generator) * 3
    rotary = torch.cat([angles.cos(), angles.sin()], dim=1)
    # sequence 0: positions 0-4 in slots 0-4 (0-1 cached); sequence 1: positions 0-3 in slots 8-11
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[0, :5], table[1, :4] = torch.arange(5), torch.arange(8, 12)
    prefix, tokens = torch.randn(2, HIDDEN, generator=generator), torch.randn(7, HIDDEN, generator=generator)
    positions = torch.tensor([2, 3, 4, 0, 1, 2, 3])
    slot = torch.tensor([2, 3, 4, 8, 9, 10, 11])

    def a_step():
        step, caches = one_layer_step(kernel, weights, tiles, rotary, slots=16)
        one = torch.ones(1, dtype=torch.long)
        for position in range(2):  # sequence 0's cached prefix
            step.forward(prefix[position:position + 1], one * position, one * position, table, one * 0,
                         one * (position + 1), None, [], lambda *args: None, 64)
        return step, caches

    step, caches = a_step()
    extended = step.forward(tokens, positions, slot, table, torch.tensor([0, 1]), torch.tensor([5, 4]),
                            torch.tensor([3, 4]), [], lambda *args: None, 64)
    stepped, stepped_caches = a_step()
    one = torch.ones(1, dtype=torch.long)
    rows = [stepped.forward(tokens[r:r + 1], one * positions[r], one * slot[r], table, one * (0 if r < 3 else 1),
                            one * (positions[r] + 1), None, [], lambda *args: None, 64) for r in range(7)]
    torch.testing.assert_close(extended, torch.cat(rows), rtol=1e-5, atol=1e-5)
    for got, expected in zip(caches, stepped_caches):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert caches[0][slot].abs().sum() > 0  # the new tokens' keys were written
    with pytest.raises(RuntimeError, match="extend"):
        step.forward(tokens, positions, slot, table, torch.tensor([0, 1]), torch.tensor([5, 4]),
                     torch.tensor([3, 3]), [], lambda *args: None, 64)


def test_the_compiled_step_runs_on_amx_tiles_above_its_grid_rows_and_the_grid_below():
    """A one-layer step over 40 one-token sequences: built for AMX, with grid_rows 0 the products run on the tiles
    (x and W rounded to bf16), within bf16's rounding of the grid step's output and not equal to it; with grid_rows
    40 the grid step's output exactly; a step built without AMX reads the grids at any grid_rows."""
    from policies import cpu_linear

    kernel = lean_decode.step_kernel()
    if kernel is None or cpu_linear.amx_kernels() is None:
        pytest.skip("no AMX product on this CPU or build")
    rows = 40
    weights, tiles = one_layer_grids(7)
    rotary = torch.cat([torch.ones(4, HEAD_DIM // 2), torch.zeros(4, HEAD_DIM // 2)], dim=1)  # cos 1, sin 0

    def run(amx, grid_rows):
        step, _ = one_layer_step(kernel, weights, tiles, rotary, slots=rows, amx=amx)
        table = torch.arange(rows, dtype=torch.int32)[:, None].repeat(1, 4)
        ones = torch.ones(rows, dtype=torch.long)
        return step.forward(torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1)), ones * 0,
                            torch.arange(rows), table, torch.arange(rows), ones, None, [], lambda *args: None,
                            grid_rows)

    from_grid = run(False, 0)
    assert torch.equal(run(True, rows), from_grid)
    on_tiles = run(True, 0)
    assert not torch.equal(on_tiles, from_grid)
    torch.testing.assert_close(on_tiles, from_grid, rtol=0, atol=0.05)
