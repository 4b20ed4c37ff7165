"""A stand-in for prime-rl's orchestrator, built from its message fields (formats.py): samples
the floe sampler, makes `TrainingSample`s (one-turn and multi-turn with masked env tokens),
packs them into `MicroBatch`es as prime-rl's packer does (position ids restart per sample,
padding appended to the last sample with loss_mask False) and writes rollouts/step_N/rank_0.bin."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import floe
from floe.integrations.prime_rl.formats import STABLE, MicroBatch, TrainingSample, broadcast_dir, write_micro_batches


def make_samples(client: floe.Client, seed: int, temperature: float = 1.0) -> list[TrainingSample]:
    """Two groups of two rollouts each, one group multi-turn, with group-centred advantages."""
    rng = random.Random(seed)
    params = floe.SamplingParams(max_tokens=5, temperature=temperature, seed=seed, stop_at_eos=False)
    out: list[TrainingSample] = []
    vocab = client.info().vocab_size
    for g in range(2):
        prompt = [rng.randrange(3, vocab) for _ in range(4 + g)]
        res = client.sample([prompt], n=2, params=params).groups[0]
        rewards = [rng.random() for _ in res.samples]
        mean = sum(rewards) / len(rewards)
        for s, r in zip(res.samples, rewards):
            ids, mask, lps = list(prompt), [False] * len(prompt), [0.0] * len(prompt)
            ids += s.tokens
            mask += [True] * len(s.tokens)
            lps += s.logprobs
            if g == 1:  # a second turn: env tokens (not trained), then the model's reply
                env = [rng.randrange(3, vocab) for _ in range(3)]
                ids += env
                mask += [False] * len(env)
                lps += [0.0] * len(env)
                reply = client.sample([ids], n=1, params=params).groups[0].samples[0]
                ids += reply.tokens
                mask += [True] * len(reply.tokens)
                lps += reply.logprobs
            adv = [0.0 if not m else r - 0.5 * mean for m in mask]  # not zero-sum: step 1 has r = 1
            out.append(TrainingSample(token_ids=ids, mask=mask, logprobs=lps, temperatures=[temperature] * len(ids),
                                      env_name="stand-in", advantages=adv))
    return out


def pack(samples: list[TrainingSample], per_batch: int = 2, pad_to: int = 8) -> list[MicroBatch]:
    batches = []
    for i in range(0, len(samples), per_batch):
        chunk = samples[i:i + per_batch]
        mb = MicroBatch(input_ids=[], loss_mask=[], advantages=[], inference_logprobs=[], position_ids=[],
                        sequence_lengths=[], temperatures=[], env_names=[], seq_lens=[])
        for s in chunk:
            mb.input_ids += s.token_ids
            mb.loss_mask += s.mask
            mb.advantages += s.advantages or [0.0] * len(s.token_ids)
            mb.inference_logprobs += s.logprobs
            mb.position_ids += list(range(len(s.token_ids)))
            mb.sequence_lengths.append(len(s.token_ids))
            mb.seq_lens.append(len(s.token_ids))
            mb.temperatures += s.temperatures
            mb.env_names += [s.env_name] * len(s.token_ids)
        pad = (pad_to - len(mb.input_ids) % pad_to) % pad_to
        mb.input_ids += [1] * pad
        mb.loss_mask += [False] * pad
        mb.advantages += [0.0] * pad
        mb.inference_logprobs += [0.0] * pad
        mb.position_ids += list(range(pad))
        mb.sequence_lengths[-1] += pad
        mb.seq_lens[-1] += pad
        mb.temperatures += [1.0] * pad
        mb.env_names += ["stand-in"] * pad
        batches.append(mb)
    return batches


def write_step(run_dir: Path, step: int, client: floe.Client) -> list[TrainingSample]:
    samples = make_samples(client, seed=step)
    write_micro_batches(run_dir, step, 0, pack(samples))
    return samples


def serve_steps(run_dir: Path, client: floe.Client, steps: int, errors: list[BaseException],
                first: int = 1) -> threading.Thread:
    """prime-rl's orchestrator loop in a thread: for step first..steps, wait for broadcasts/step_{n-1}/STABLE,
    then write step n's rollouts sampled by `client` (a fork of the trainer's). Errors go to `errors`."""

    def loop() -> None:
        try:
            for step in range(first, steps + 1):
                marker = broadcast_dir(run_dir, step - 1) / STABLE
                while not marker.exists():
                    time.sleep(0.02)
                write_step(run_dir, step, client)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test thread
            errors.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread
