"""The server's metrics count what each operation did, through the operation's record in
OPS (its observe hook), not through checks on result types."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from floe import Batch, Group, Sample
from floe.protocol.ops import OPS
from floe.server.metrics import Metrics
from floe.types import ForwardResult, OptimStepResult, SampledGroup, SampledSequence, SampleResult, StateResult, SyncResult


def values(metrics: Metrics) -> dict[str, float]:
    return {
        s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples if s.name.startswith("floe_") and not s.name.startswith("floe_http")
        and not s.name.endswith("_created")
    }


def test_each_operation_reports_through_its_hook() -> None:
    m = Metrics()
    sampled = SampleResult([SampledGroup([1], [SampledSequence([2, 3], [-1.0, -1.0], "length", 0)])], 0, num_tokens=2, seconds=0.1)
    batch = Batch([Group([1], [Sample([2, 3, 4]), Sample([5])])])
    m.observe_result("sample", {"prompts": [[1]]}, sampled)
    m.observe_result("forward_backward", {"batch": batch}, object())
    m.observe_result("forward", {"batch": batch}, ForwardResult([[[-1.0, -1.0, -1.0], [-1.0]]]))  # counts nothing
    m.observe_result("optim_step", {}, OptimStepResult(7, 1e-5, 0.5, 1))
    m.observe_result("sync_weights", {}, SyncResult(3, 1024, 0.25))
    got = values(m)
    assert got["floe_tokens_sampled_total"] == 2 and got["floe_tokens_trained_total"] == 4
    assert got["floe_policy_step"] == 7 and got["floe_weights_version"] == 3
    assert got["floe_sync_seconds_count"] == 1 and got["floe_sync_seconds_sum"] == 0.25
    m.observe_result("save_state", {"name": "a"}, StateResult("a", "/s/a", 9, 9))  # saving changes no gauge
    assert values(m)["floe_policy_step"] == 7
    m.observe_result("load_state", {"name": "a"}, StateResult("a", "/s/a", 2, 1))
    assert (values(m)["floe_policy_step"], values(m)["floe_weights_version"]) == (2, 1)


def test_hooks_are_on_the_records() -> None:
    observed = {name for name, op in OPS.items() if op.observe is not None}
    assert observed == {"sample", "forward_backward", "optim_step", "sync_weights", "load_state"}
