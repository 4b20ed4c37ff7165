"""forward_backward gradients against a naive per-sample reference written here.

The reference runs the HF model on each sample's full sequence separately, takes
log_softmax of the temperature-scaled logits, and evaluates each loss formula of
docs/losses.md token by token with plain Python loops. Tolerance: relative error < 1e-5 of
the whole gradient vector (fp32).
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

import floe
from tests.conftest import backend_of

LOSSES = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low": 0.1, "clip_high": 0.15, "dual_clip": 2.0},
    "cispo": {"clip_low": 0.1, "clip_high": 0.1},
    "gspo": {"clip_low": 0.02, "clip_high": 0.03},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "dppo": {"divergence": "binary_tv", "delta_low": 0.002, "delta_high": 0.002},
    "geo_mean": {"clip_low": 0.1, "clip_high": 0.15},
    "clip_cov": {"clip_low": 0.1, "clip_high": 0.15, "clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 0.3, "ppo_kl_coef": 0.5},
}
# Variants of the new losses' keys, checked with one aggregation each.
VARIANTS = [
    ("dppo", {"divergence": "binary_kl", "delta_low": 0.0005, "delta_high": 0.0005}),
    ("dppo", {"divergence": "binary_tv", "delta_low": 0.002, "delta_high": 0.002, "surrogate": "log_prob", "ratio_cap": 1.05}),
    ("dppo", {"divergence": "binary_kl", "delta_low": 0.0005, "delta_high": 0.0005, "surrogate": "log_prob"}),
    ("cispo", {"clip_low": 0.1, "clip_high": 0.1, "out_of_range": "zero"}),
    ("gspo", {"clip_low": 0.02, "clip_high": 0.03, "ratio_gradient": "token", "log_ratio_cap": 0.05}),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 0.5}),
]
SEED = 1234  # torch's generator before each clip_cov call (it draws the dropped tokens)
AGGREGATIONS = ["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
TEMPERATURE = 0.9


def make_batch(vocab: int, seed: int, with_ref: bool = True) -> floe.Batch:
    """Two groups with ragged samples, per-token and scalar advantages, zero-weight tokens,
    and old log-probs far enough from the current ones that every clip branch is taken."""
    rng = random.Random(seed)
    groups = []
    for g, (plen, lens) in enumerate([(5, [3, 7, 4]), (9, [6, 2])]):
        prompt = [rng.randrange(8, vocab) for _ in range(plen)]
        samples = []
        for i, n in enumerate(lens):
            adv: float | list[float] = rng.uniform(-2, 2) if (g + i) % 2 else [rng.uniform(-2, 2) for _ in range(n)]
            weights = [1.0 if rng.random() > 0.2 else 0.0 for _ in range(n)]
            weights[0] = 1.0
            samples.append(
                floe.Sample(
                    tokens=[rng.randrange(8, vocab) for _ in range(n)],
                    logprobs=[-4.6 + rng.uniform(-0.6, 0.6) for _ in range(n)],
                    advantage=adv,
                    weights=weights,
                    ref_logprobs=[-4.6 + rng.uniform(-0.5, 0.5) for _ in range(n)] if with_ref else None,
                )
            )
        groups.append(floe.Group(prompt, samples))
    return floe.Batch(groups)


def naive_token_logprobs(model, prompt: list[int], tokens: list[int], temperature: float):
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    out, ent = [], []
    for t, tok in enumerate(tokens):
        row = logsm[len(prompt) - 1 + t]
        out.append(row[tok])
        ent.append(-(row.exp() * row).sum())
    return out, ent


def _advantages(s: floe.Sample) -> list[float]:
    return s.advantage if isinstance(s.advantage, list) else [s.advantage] * len(s.tokens)


def naive_selection(name: str, cfg: dict, samples, scored) -> set[tuple[int, int]]:
    """(sample, token) pairs clip_cov drops / kl_cov penalises, over every token of the batch:
    covariance (A − mean A)(logp − mean logp) over the tokens with w != 0, in batch order."""
    valid = [(i, t) for i, (_, s) in enumerate(samples) for t in range(len(s.tokens)) if (s.weights or [1.0] * 99)[t] != 0]
    adv = {(i, t): _advantages(samples[i][1])[t] for i, t in valid}
    lp = {(i, t): float(scored[i][0][t].detach()) for i, t in valid}
    mean_a, mean_l = sum(adv.values()) / len(valid), sum(lp.values()) / len(valid)
    cov = {k: (adv[k] - mean_a) * (lp[k] - mean_l) for k in valid}
    if name == "kl_cov":
        k = max(1, int(len(valid) * cfg["kl_cov_ratio"]))
        return set(sorted(valid, key=lambda key: -cov[key])[:k])
    lo, hi = 1 - cfg["clip_low"], 1 + cfg["clip_high"]
    candidates = []
    for i, t in valid:
        r = math.exp(lp[(i, t)] - samples[i][1].logprobs[t])
        by_clip = -adv[(i, t)] * min(max(r, lo), hi) > -adv[(i, t)] * r
        if not by_clip and cfg["clip_cov_lb"] < cov[(i, t)] < cfg["clip_cov_ub"]:
            candidates.append((i, t))
    count = max(int(cfg["clip_cov_ratio"] * len(valid)), 1)
    torch.manual_seed(SEED)
    return {candidates[j] for j in torch.randperm(len(candidates))[:count].tolist()} if candidates else set()


def dppo_keeps(cfg: dict, lp: float, old: float, A: float) -> bool:
    p, q = math.exp(lp), math.exp(old)
    lo, hi = cfg.get("delta_low", 0.2), cfg.get("delta_high", 0.2)
    if cfg.get("divergence", "binary_tv") == "binary_tv":
        return p - q <= hi if A > 0 else p - q >= -lo
    d = q * (old - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return (d <= hi or p <= q) if A > 0 else (d <= lo or p >= q)


def naive_loss(model, batch: floe.Batch, name: str, cfg: dict, aggregation: str, kl, ent_coef, norm_length=None,
               kl_aggregation=None, entropy_aggregation=None):
    """The loss of docs/losses.md: per sample the weighted sums of ℓ, of the KL estimate and of the
    entropy, each term aggregated by its own aggregation (None: `aggregation`)."""
    samples = [(g.prompt, s) for g in batch.groups for s in g.samples]
    per_sample_sums, kl_sums, ent_sums, per_sample_wsum, lengths = [], [], [], [], []
    lo, hi = 1 - cfg.get("clip_low", 0.2), 1 + cfg.get("clip_high", 0.2)
    scored = [naive_token_logprobs(model, prompt, s.tokens, TEMPERATURE) for prompt, s in samples]
    selected = naive_selection(name, cfg, samples, scored) if name in ("clip_cov", "kl_cov") else set()
    for index, (prompt, s) in enumerate(samples):
        logps, ents = scored[index]
        n = len(s.tokens)
        w = s.weights or [1.0] * n
        adv = _advantages(s)
        if name == "gspo":
            active = [t for t in range(n) if w[t] != 0]
            log_s = sum(logps[t] - s.logprobs[t] for t in active) / len(active)
        if name == "geo_mean":
            active = [t for t in range(n) if w[t] != 0]
            kept = []
            for t in active:
                d = logps[t] - s.logprobs[t]
                if adv[t] > 0:
                    kept.append(d.clamp(max=cfg["clip_high"]))
                elif adv[t] < 0:
                    kept.append(d.clamp(min=-cfg["clip_low"]))
                else:
                    kept.append(d * 0.0)
            geo = -sum(adv[t] for t in active) / len(active) * torch.exp(sum(kept) / len(active))
        total, kl_total, ent_total = 0.0, 0.0, 0.0
        for t in range(n):
            lp = logps[t]
            if name == "cross_entropy":
                loss = -lp
            else:
                r = torch.exp(lp - s.logprobs[t])
                A = adv[t]
                if name == "importance_sampling":
                    loss = -r * A
                elif name == "ppo":
                    loss = -torch.minimum(r * A, r.clamp(lo, hi) * A)
                    if A < 0:
                        loss = torch.minimum(loss, torch.tensor(-cfg["dual_clip"] * A))
                elif name == "cispo" and cfg.get("out_of_range") == "zero":
                    loss = -(r.detach() if lo < float(r) < hi else 0.0) * A * lp
                elif name == "cispo":
                    loss = -r.clamp(lo, hi).detach() * A * lp
                elif name == "gspo":
                    log_st = log_s
                    if cfg.get("ratio_gradient") == "token":  # GSPO-token: s's value, the token's own gradient
                        log_st = log_s.detach() + lp - lp.detach()
                    if cfg.get("log_ratio_cap") is not None:
                        log_st = log_st.clamp(max=cfg["log_ratio_cap"])
                    ratio = torch.exp(log_st)
                    loss = -torch.minimum(ratio * A, ratio.clamp(lo, hi) * A)
                elif name == "sapo":
                    tau = cfg["tau_pos"] if A > 0 else cfg["tau_neg"]
                    loss = -torch.sigmoid(tau * (r - 1)) * 4 / tau * A
                elif name == "dppo":
                    keep = dppo_keeps(cfg, float(lp.detach()), s.logprobs[t], A)
                    if cfg.get("surrogate", "ratio") == "ratio":
                        loss = -r * A * keep
                    else:
                        weight = r.detach() if cfg.get("ratio_cap") is None else r.detach().clamp(max=cfg["ratio_cap"])
                        loss = -A * weight * lp * keep
                elif name == "geo_mean":
                    loss = geo
                elif name == "clip_cov":
                    loss = -torch.minimum(r * A, r.clamp(lo, hi) * A) * (0.0 if (index, t) in selected else 1.0)
                elif name == "kl_cov":
                    loss = -A * r + (cfg["ppo_kl_coef"] * (lp - s.logprobs[t]).abs() if (index, t) in selected else 0.0)
            if kl:
                d = lp - s.ref_logprobs[t]
                k = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1}[kl[1]]
                kl_total = kl_total + w[t] * kl[0] * k
            if ent_coef:
                ent_total = ent_total - w[t] * ent_coef * ents[t]
            total = total + w[t] * loss
        per_sample_sums.append(total)
        kl_sums.append(kl_total)
        ent_sums.append(ent_total)
        per_sample_wsum.append(sum(w))
        lengths.append(n)
    N = len(samples)

    def aggregate(sums, how):
        if how == "sum":
            return sum(sums)
        if how == "token_mean":
            return sum(sums) / sum(per_sample_wsum)
        if how == "seq_mean_token_mean":
            return sum(x / w for x, w in zip(sums, per_sample_wsum)) / N
        return sum(sums) / (N * (norm_length or max(lengths)))

    return (aggregate(per_sample_sums, aggregation) + aggregate(kl_sums, kl_aggregation or aggregation)
            + aggregate(ent_sums, entropy_aggregation or aggregation))


def flat_grads(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def reference_grads(model, params, *args, **kwargs) -> tuple[torch.Tensor, float]:
    for p in params:
        p.grad = None
    loss = naive_loss(model, *args, **kwargs)
    loss.backward()
    g = flat_grads(params).clone()
    for p in params:
        p.grad = None
    return g, float(loss.detach())


def take_grads(backend) -> torch.Tensor:
    """The policy's accumulated gradient as one vector; then clears it (tests only compare)."""
    got = flat_grads(backend.policy.params).clone()
    for p in backend.policy.params:
        p.grad = None
    backend.policy.pending_calls = 0
    return got


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    # Small micro-batches so the batch is split, groups included: exercises exact aggregation.
    cfg = floe.BackendConfig(
        model=str(tiny_model), state_dir=str(tmp_path_factory.mktemp("s")),
        compute=floe.ComputeConfig(max_tokens_per_microbatch=24),
    )
    c = floe.connect(cfg)
    yield c
    c.close()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_gradients_match_naive_reference(client, loss, aggregation):
    backend = backend_of(client)
    model, params = backend.policy.model, backend.policy.params
    batch = make_batch(backend.vocab_size, seed=zlib.crc32(f"{loss}:{aggregation}".encode()) % 1000)
    if loss == "cross_entropy":
        for g in batch.groups:
            for s in g.samples:
                s.advantage = None
    cfg = dict(LOSSES[loss], aggregation=aggregation)
    expected, expected_loss = reference_grads(model, params, batch, loss, LOSSES[loss], aggregation, None, 0.0)
    torch.manual_seed(SEED)
    result = client.forward_backward(batch, loss, cfg, temperature=TEMPERATURE)
    got = take_grads(backend)
    assert rel_err(got, expected) < 1e-5
    assert math.isclose(result.metrics["loss"], expected_loss, rel_tol=1e-5, abs_tol=1e-6)
    assert result.loss_config["aggregation"] == aggregation
    if loss in ("dppo", "clip_cov", "kl_cov", "geo_mean"):
        assert 0 < result.metrics["clip_fraction"] < 1  # masks / selections / clips really bite


@pytest.mark.parametrize(("loss", "cfg"), VARIANTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(VARIANTS)])
def test_loss_variants_match_naive_reference(client, loss, cfg):
    """The keys of the framework losses (dppo's divergences and surrogates, cispo's zero outside
    the range, gspo's log-ratio cap, sapo's temperatures) against the same naive reference."""
    backend = backend_of(client)
    model, params = backend.policy.model, backend.policy.params
    batch = make_batch(backend.vocab_size, seed=zlib.crc32(f"{loss}:{cfg}".encode()) % 1000)
    expected, expected_loss = reference_grads(model, params, batch, loss, cfg, "token_mean", None, 0.0)
    result = client.forward_backward(batch, loss, cfg, temperature=TEMPERATURE)
    got = take_grads(backend)
    assert rel_err(got, expected) < 1e-5
    assert math.isclose(result.metrics["loss"], expected_loss, rel_tol=1e-5, abs_tol=1e-6)
    if loss != "sapo":
        assert 0 < result.metrics["clip_fraction"] < 1


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_batch_statistic_does_not_depend_on_micro_batching(client, tiny_model, tmp_path, loss):
    """clip_cov / kl_cov select tokens over the whole call: one micro-batch per sample and one
    micro-batch for everything give the same loss and gradients."""
    split, one = _split_and_whole(client, tiny_model, tmp_path, loss, dict(LOSSES[loss], aggregation="token_mean"), 99)
    assert split.metrics["clip_fraction"] == one.metrics["clip_fraction"] > 0


def _split_and_whole(client, tiny_model, tmp_path, loss: str, cfg: dict, seed: int):
    """One call on `client`'s micro-batches and the same call as one micro-batch on a fresh
    backend: loss and gradients must agree (rel 1e-5). Returns both results."""
    backend = backend_of(client)
    batch = make_batch(backend.vocab_size, seed=seed)
    torch.manual_seed(SEED)
    split = client.forward_backward(batch, loss, cfg, temperature=TEMPERATURE)
    split_grads = take_grads(backend)
    whole_cfg = floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path / "s"),
                                   compute=floe.ComputeConfig(max_tokens_per_microbatch=4096))
    with floe.connect(whole_cfg) as whole:
        torch.manual_seed(SEED)
        one = whole.forward_backward(batch, loss, cfg, temperature=TEMPERATURE)
        one_grads = take_grads(backend_of(whole))
    assert rel_err(split_grads, one_grads) < 1e-5
    assert math.isclose(split.metrics["loss"], one.metrics["loss"], rel_tol=1e-5)
    return split, one


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gspo_token_gradients_match_naive_reference(client, aggregation):
    """gspo with ratio_gradient="token" (GSPO-token, Tinker's gspo): every token's ratio has the
    sequence ratio's value and the gradient of its own log-prob; per-token advantages differ
    within a sample (make_batch), which is where it differs from the sequence gradient."""
    backend = backend_of(client)
    model, params = backend.policy.model, backend.policy.params
    batch = make_batch(backend.vocab_size, seed=zlib.crc32(f"gspo-token:{aggregation}".encode()) % 1000)
    cfg = {"clip_low": 0.02, "clip_high": 0.03, "ratio_gradient": "token"}
    expected, expected_loss = reference_grads(model, params, batch, "gspo", cfg, aggregation, None, 0.0)
    sequence, _ = reference_grads(model, params, batch, "gspo", dict(cfg, ratio_gradient="sequence"), aggregation,
                                  None, 0.0)
    result = client.forward_backward(batch, "gspo", dict(cfg, aggregation=aggregation), temperature=TEMPERATURE)
    got = take_grads(backend)
    assert rel_err(got, expected) < 1e-5
    assert rel_err(sequence, expected) > 1e-3  # the two gradients really differ on this batch
    assert math.isclose(result.metrics["loss"], expected_loss, rel_tol=1e-5, abs_tol=1e-6)
    assert result.loss_config["ratio_gradient"] == "token"


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_and_entropy_terms_match_reference(client, estimator):
    backend = backend_of(client)
    model, params = backend.policy.model, backend.policy.params
    batch = make_batch(backend.vocab_size, seed=7)
    cfg = {"kl": {"coef": 0.3, "estimator": estimator}, "entropy": {"coef": 0.05}, "aggregation": "token_mean"}
    expected, _ = reference_grads(model, params, batch, "ppo", {"dual_clip": 3.0}, "token_mean", (0.3, estimator), 0.05)
    client.forward_backward(batch, "ppo", dict(cfg, dual_clip=3.0), temperature=TEMPERATURE)
    got = take_grads(backend)
    assert rel_err(got, expected) < 1e-5


def test_norm_length_override(client):
    backend = backend_of(client)
    model, params = backend.policy.model, backend.policy.params
    batch = make_batch(backend.vocab_size, seed=3)
    expected, _ = reference_grads(model, params, batch, "importance_sampling", {}, "seq_mean_token_sum_norm", None, 0.0, norm_length=50)
    client.forward_backward(batch, "importance_sampling", {"aggregation": "seq_mean_token_sum_norm", "norm_length": 50}, temperature=TEMPERATURE)
    got = take_grads(backend)
    assert rel_err(got, expected) < 1e-5


def test_gradients_accumulate_across_calls(client):
    """Two forward_backward calls with `sum` aggregation add up to one call on both batches."""
    backend = backend_of(client)
    a, b = make_batch(backend.vocab_size, 11), make_batch(backend.vocab_size, 12)
    client.forward_backward(floe.Batch(a.groups + b.groups), "ppo", {"aggregation": "sum"})
    together = take_grads(backend)
    client.forward_backward(a, "ppo", {"aggregation": "sum"})
    client.forward_backward(b, "ppo", {"aggregation": "sum"})
    assert backend.policy.pending_calls == 2
    separate = take_grads(backend)
    assert rel_err(separate, together) < 1e-5


def test_metrics_report_clipping_and_ratios(client):
    backend = backend_of(client)
    batch = make_batch(backend.vocab_size, seed=5)
    res = client.forward_backward(batch, "ppo", {"clip_low": 0.01, "clip_high": 0.01})
    take_grads(backend)
    m = res.metrics
    assert 0 < m["clip_fraction"] <= 1
    assert m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]
    assert m["tokens"] == sum(sum(1 for w in s.weights if w) for g in batch.groups for s in g.samples)
    assert m["entropy"] > 0 and m["kl_sampler_k3"] >= 0 and m["kl_ref_k3"] >= 0
    assert res.loss_config["clip_low"] == 0.01 and res.loss_config["dual_clip"] is None
    # The returned log-probs are the policy's, aligned with each sample's tokens.
    fwd = client.forward(batch)
    for g_res, g_fwd in zip(res.logprobs, fwd.logprobs):
        for a, b in zip(g_res, g_fwd):
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_batch_statistic_travels_with_data_parallel_shares(client, loss):
    """The data-parallel path without the ranks: the driver's pre-pass statistics
    (`batch_token_stats`) split with the shares (`split_batch`), each share run through the
    ranks' micro-batch loop (`accumulate_microbatches`) with its global scales and statistics,
    the shares' gradients summed: the same gradients as one process (the ranks sum theirs)."""
    one, shares, sums, replay = _replay_shares(client, loss, dict(LOSSES[loss], aggregation="seq_mean_token_mean"), 42)
    assert all(share.stats is not None for share in shares)
    assert any(v for share in shares for s in share.stats for v in s)  # some token is selected
    assert math.isclose(sum(p["clipped_tokens"] for p in sums), one.metrics["clip_fraction"] * one.metrics["tokens"])
    with pytest.raises(ValueError, match="batch statistics"):  # the statistic is never silently left out
        replay(shares[-1], None)


def _replay_shares(client, loss: str, cfg: dict, seed: int):
    """One process's forward_backward on a batch, then the same batch as the driver splits it for
    2 data-parallel ranks (`split_batch`), each share run through the ranks' micro-batch loop
    (`accumulate_microbatches`) with its own scales and statistics: the shares' gradients summed
    must equal one process's (rel 1e-5). Returns (one process's result, the shares, every micro-
    batch's metric sums, `replay(share, stats)` that runs one share again)."""
    from floe.backend.data_parallel import split_batch  # noqa: PLC0415
    from floe.backend.policy import accumulate_microbatches, batch_token_stats, score_flat  # noqa: PLC0415
    from floe.backend.scoring import plan_batch, uses_prefix_dedup  # noqa: PLC0415
    from floe.compute.losses import resolve_loss  # noqa: PLC0415

    backend = backend_of(client)
    zone = backend.policy
    batch = make_batch(backend.vocab_size, seed=seed)
    torch.manual_seed(SEED)
    one = client.forward_backward(batch, loss, cfg, temperature=TEMPERATURE)
    expected = take_grads(backend)

    spec = resolve_loss(loss, cfg)
    device = torch.device("cpu")
    torch.manual_seed(SEED)
    stats = batch_token_stats(batch, spec, zone.forward(batch, TEMPERATURE, False).logprobs, device)
    shares = split_batch(batch, 2, spec, stats)

    def replay(share, share_stats):
        sub = share.batch
        assert sub is not None
        plan = plan_batch(sub, zone.compute, uses_prefix_dedup(zone.model, zone.compute), zone.model)

        def score(mb):
            return score_flat(zone.model, sub, mb, TEMPERATURE, True, zone.compute)

        return accumulate_microbatches(score, sub, plan, share.scales, spec, device, share_stats)[1]

    sums = [p for share in shares for p in replay(share, share.stats)]
    assert rel_err(take_grads(backend), expected) < 1e-5
    return one, shares, sums, replay


# Each term under its own aggregation (kl.aggregation / entropy.aggregation): (loss, its keys,
# policy aggregation, KL aggregation, entropy aggregation), the frameworks' combinations among them:
# verl's geo_mean / sapo (policy by sequence mean, KL and entropy by loss_agg_mode), SkyRL's summed
# pre-scaled policy term with the KL as a per-sequence token mean (clip_cov and kl_cov included).
TERM_AGGREGATIONS = [
    ("geo_mean", LOSSES["geo_mean"], "seq_mean_token_mean", "token_mean", "token_mean"),
    ("sapo", LOSSES["sapo"], "seq_mean_token_mean", "seq_mean_token_sum_norm", "sum"),
    ("ppo", LOSSES["ppo"], "sum", "seq_mean_token_mean", None),
    ("clip_cov", LOSSES["clip_cov"], "sum", "seq_mean_token_mean", "token_mean"),
    ("kl_cov", LOSSES["kl_cov"], "sum", "seq_mean_token_mean", None),
    ("importance_sampling", {}, "token_mean", None, "sum"),
]
TERM_IDS = [f"{n}-{p}-kl_{k}-ent_{e}" for n, _, p, k, e in TERM_AGGREGATIONS]
KL_TERM, ENT_COEF = (0.4, "k3"), 0.05


def _term_cfg(keys: dict, policy: str, kl: str | None, entropy: str | None) -> dict:
    return dict(keys, aggregation=policy, kl={"coef": KL_TERM[0], "estimator": KL_TERM[1], "aggregation": kl},
                entropy={"coef": ENT_COEF, "aggregation": entropy})


@pytest.mark.parametrize(("loss", "keys", "policy", "kl", "entropy"), TERM_AGGREGATIONS, ids=TERM_IDS)
def test_kl_and_entropy_aggregations_match_naive_reference(client, loss, keys, policy, kl, entropy):
    """loss = policy term under `aggregation` + coef·KL under `kl.aggregation` − coef·H under
    `entropy.aggregation`: loss and gradients against the naive reference (each term aggregated
    on its own), over micro-batches of 24 tokens; the result reports each term's aggregation;
    and the separate aggregation really changes the gradient (one shared aggregation differs)."""
    backend = backend_of(client)
    model, params = backend.policy.model, backend.policy.params
    batch = make_batch(backend.vocab_size, seed=zlib.crc32(f"terms:{loss}:{policy}:{kl}:{entropy}".encode()) % 1000)
    expected, expected_loss = reference_grads(model, params, batch, loss, keys, policy, KL_TERM, ENT_COEF,
                                              kl_aggregation=kl, entropy_aggregation=entropy)
    shared, _ = reference_grads(model, params, batch, loss, keys, policy, KL_TERM, ENT_COEF)
    torch.manual_seed(SEED)
    result = client.forward_backward(batch, loss, _term_cfg(keys, policy, kl, entropy), temperature=TEMPERATURE)
    got = take_grads(backend)
    assert rel_err(got, expected) < 1e-5
    assert math.isclose(result.metrics["loss"], expected_loss, rel_tol=1e-5, abs_tol=1e-6)
    assert rel_err(shared, expected) > 1e-3  # the term's own aggregation matters on this batch
    assert result.loss_config["aggregation"] == policy
    assert result.loss_config["kl"]["aggregation"] == (kl or policy)
    assert result.loss_config["entropy"]["aggregation"] == (entropy or policy)


@pytest.mark.parametrize(("loss", "keys", "policy", "kl", "entropy"), TERM_AGGREGATIONS[:4], ids=TERM_IDS[:4])
def test_kl_and_entropy_aggregations_do_not_depend_on_micro_batching(client, tiny_model, tmp_path, loss, keys, policy,
                                                                     kl, entropy):
    """The KL's and entropy's scales are fixed over the whole call like the policy term's: micro-
    batches of 24 tokens and one micro-batch for everything give the same loss and gradients."""
    _split_and_whole(client, tiny_model, tmp_path, loss, _term_cfg(keys, policy, kl, entropy), 77)


@pytest.mark.parametrize(("loss", "keys", "policy", "kl", "entropy"), [TERM_AGGREGATIONS[0], TERM_AGGREGATIONS[3]],
                         ids=[TERM_IDS[0], TERM_IDS[3]])
def test_kl_and_entropy_scales_travel_with_data_parallel_shares(client, loss, keys, policy, kl, entropy):
    """The data-parallel path without the ranks (as for the batch statistic above): each share
    carries its samples' global scales of every term (`RankShare.scales`), the shares' gradients
    summed are one process's."""
    one, shares, sums, _ = _replay_shares(client, loss, _term_cfg(keys, policy, kl, entropy), 43)
    assert all(share.batch is not None and share.scales.kl != share.scales.policy for share in shares)
    assert math.isclose(sum(p["loss"] for p in sums), one.metrics["loss"], rel_tol=1e-5)


def test_term_aggregation_keys_are_validated():
    """kl.aggregation / entropy.aggregation: one of the aggregations (InvalidInput naming the key);
    norm_length is accepted when any term uses seq_mean_token_sum_norm, refused when none does."""
    from floe.compute.losses import resolve_loss  # noqa: PLC0415

    with pytest.raises(floe.InvalidInput, match=r"loss_config\.kl\.aggregation"):
        resolve_loss("ppo", {"kl": {"coef": 0.1, "aggregation": "mean"}})
    with pytest.raises(floe.InvalidInput, match=r"loss_config\.entropy\.aggregation"):
        resolve_loss("ppo", {"entropy": {"coef": 0.1, "aggregation": "token-mean"}})
    spec = resolve_loss("ppo", {"kl": {"coef": 0.1, "aggregation": "seq_mean_token_sum_norm"}, "norm_length": 9})
    assert spec.config.term_aggregations() == ("token_mean", "seq_mean_token_sum_norm", "token_mean")
    with pytest.raises(floe.InvalidInput, match="norm_length"):
        resolve_loss("ppo", {"kl": {"coef": 0.1, "aggregation": "sum"}, "norm_length": 9})
    resolved = resolve_loss("ppo", None).resolved()  # the defaults report the aggregation that runs
    assert resolved["kl"]["aggregation"] == resolved["entropy"]["aggregation"] == "token_mean"
