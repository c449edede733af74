"""Step-level self-consistency in plain SGLang: fork k ways, write one step each, keep the step most forks agree on.

Nothing here imports sgl-tts: `sgl-tts run --program docs/examples/step_vote.py` runs it as it is, and the
backend beneath the DSL still tags every request with its place in the fork tree (for the prefix-aware
scheduler), counts its tokens and cache hits, and reports goodput (docs/writing-programs.md).
"""

from collections import Counter

import sglang as sgl


@sgl.function
def program(s, prompt, k, max_steps, max_step_tokens):
    s += prompt
    chosen = s
    for _ in range(max_steps):
        chosen.text()  # commit the text so the forks' shared prefix is served from the radix cache
        forks = chosen.fork(k)
        forks += sgl.gen("step", max_tokens=max_step_tokens, stop="\n\n")  # the run's temperature
        steps = [fork["step"] for fork in forks]
        votes = Counter(step.strip() for step in steps)
        best = max(range(k), key=lambda i: (votes[steps[i].strip()], -i))
        chosen = forks[best]
        chosen += "\n\n"
        if "boxed" in steps[best] or not steps[best].strip():
            break
    return chosen.text()
