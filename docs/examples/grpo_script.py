"""GRPO in 40 lines on floe's public API: a tiny model learns to answer with the letter "a"."""

import json
import sys
import tempfile

import floe
from floe.models import make_tiny

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
model_dir = make_tiny(tempfile.mkdtemp() + "/tiny")  # random weights, built locally, nothing downloaded
client = floe.connect(floe.BackendConfig(model=str(model_dir), optimizer={"lr": 3e-3}))
chat = floe.chat.Renderer(client.tokenizer())
prompts = [chat.render([{"role": "user", "content": f"Say a{'!' * k}"}]) for k in range(4)]


def reward(tokens: list[int]) -> float:
    """Toy reward: the share of the letter 'a' in the answer."""
    text = chat.decode(tokens)
    return text.count("a") / max(len(text), 1)


for step in range(STEPS):
    out = client.sample(prompts, n=8, params=floe.SamplingParams(max_tokens=12, temperature=0.7, seed=step))
    rewards = [[reward(s.tokens) for s in g.samples] for g in out.groups]
    batch = floe.grpo.batch_from_samples(out, rewards)  # group advantages; samples keep T = 0.7
    loss = None
    if batch.groups:
        loss = client.forward_backward(batch, "ppo").metrics["loss"]  # scored at the samples' 0.7
        client.optim_step()
        client.sync_weights()
    mean = sum(map(sum, rewards)) / sum(map(len, rewards))
    print(json.dumps({"step": step, "reward": mean, "loss": loss, "groups": len(batch.groups)}), flush=True)

greedy = client.sample(prompts, params=floe.SamplingParams(max_tokens=12, temperature=0.0))
print(json.dumps({"greedy": [chat.decode(g.samples[0].tokens) for g in greedy.groups]}))
client.close()
