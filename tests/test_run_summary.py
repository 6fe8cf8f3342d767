"""summary.json is a typed RunSummary: the orchestrator's record, the session's outcome and the KL figures
over metrics.jsonl, with wall time summed over sessions; `status` reads it back."""

import json

import pytest

from primebuild.contracts.run_dir import RunDir, write_json_atomic
from primebuild.contracts.run_summary import OrchestratorSummary, RunSummary
from primebuild.errors import UserError
from primebuild.runtime.metrics import MetricsWriter
from primebuild.runtime.session import finish
from primebuild.runtime.supervisor import Outcome


def test_finish_writes_a_typed_summary_and_a_resume_adds_its_wall_time(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    write_json_atomic(run.run_record, {"model_info": {"steps": 12}, "model_seconds": 1.5})
    OrchestratorSummary(eval_reward_before=0.25).write(run.orchestrator_state)
    trainer = MetricsWriter(run.metrics, role="trainer")
    for step, kl in ((1, 0.5), (2, 1.5)):
        trainer.write(step, {"mismatch_kl": kl, "behaviour_kl": 2 * kl, "loss": 0.1})
    trainer.close()

    summary, _ = finish(run, Outcome(ok=False, message="stopped", exit_code=1), 10.0)
    assert (summary.eval_reward_before, summary.eval_reward_after, summary.eval_reward_gain) == (0.25, None, None)
    assert (summary.mismatch_kl_max, summary.mismatch_kl_mean, summary.mismatch_kl_steps) == (1.5, 1.0, 2)
    assert (summary.behaviour_kl_max, summary.routing_agreement_mean) == (3.0, None)
    assert (summary.sft, summary.model_seconds, summary.wall_seconds, summary.outcome) == ({"steps": 12}, 1.5, 10.0,
                                                                                         "stopped")
    on_disk = json.loads(run.summary.read_text())
    assert "eval_reward_after" not in on_disk and on_disk["mismatch_kl_mean"] == 1.0  # unmeasured: absent, not null

    # the resumed session's orchestrator finished the run
    OrchestratorSummary(eval_reward_before=0.25, eval_reward_after=0.75, eval_reward_after_step=2,
                        inference_engine={"name": "embedded", "version": "0.1.0"}).write(run.orchestrator_state)
    summary, _ = finish(run, Outcome(ok=True, message="done", exit_code=0), 5.0)
    assert summary == RunSummary.read(run.summary)
    assert (summary.eval_reward_gain, summary.wall_seconds, summary.outcome) == (0.5, 15.0, "done")
    assert summary.inference_engine.name == "embedded"


def test_a_summary_with_an_unknown_field_is_a_located_error(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"eval_reward_before": 0.1, "eval_rewrd_after": 0.2}))
    with pytest.raises(UserError, match="summary.json: eval_rewrd_after: Extra inputs are not permitted"):
        RunSummary.read(path)
    assert RunSummary.read(tmp_path / "absent.json") == RunSummary()
