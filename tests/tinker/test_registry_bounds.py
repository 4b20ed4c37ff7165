"""The registry a key fills stays bounded, with the real tinker 0.38 SDK and `tinker` CLI: a
`tinker checkpoint download` of a training checkpoint (which loads it into a temporary run and
exports it) leaves no run behind, and `[server] tinker_max_runs` counts open runs, so a key that
downloads often, or whose sessions closed, can always train again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tinker.test_persistence import _cli, _clients, _step

pytestmark = pytest.mark.tinker


def test_downloads_leave_no_run_and_the_run_limit_counts_open_runs(tinker_server, tinker_model: Path,
                                                                   tmp_path: Path) -> None:
    import tinker  # noqa: PLC0415

    server = tinker_server("tinker_max_runs = 2\n")
    service, rest = _clients(server.url)
    training = service.create_lora_training_client(base_model=str(tinker_model), rank=4, seed=0).result()
    _step(training)
    state = training.save_state("s").result().path
    for i in range(3):  # each a temporary run and export, gone when the CLI closes its session
        out = _cli(server.url, "checkpoint", "download", state, "--output", str(tmp_path / f"dl{i}"))
        assert out.returncode == 0, out.stdout + out.stderr
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [training.model_id]
    assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == [state]

    second = service.create_lora_training_client(base_model=str(tinker_model), rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="tinker_max_runs.*close\\(\\)"):
        service.create_lora_training_client(base_model=str(tinker_model), rank=4).result()
    service.close("success").result()  # both runs close: their places are free again
    again, _ = _clients(server.url)
    resumed = again.create_training_client_from_state_with_optimizer(state).result()
    assert _step(resumed) > 0
    listed = {r.training_run_id for r in rest.list_training_runs().result().training_runs}
    assert listed == {training.model_id, resumed.model_id} and second.model_id not in listed
    again.close("success").result()
