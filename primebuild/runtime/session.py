"""The end of one session of a run (a first start or a resume), whoever supervised it: summary.json
(held-out rewards, KL, wall time summed over sessions), report.png and outcome.json. `primebuild run`
calls it for the targets it supervises itself; on Slurm the in-job supervisor does, so a detached or
requeued job leaves the same run folder."""

from __future__ import annotations

from pathlib import Path

from primebuild.contracts.run_dir import OutcomeRecord, RunDir, write_json_atomic
from primebuild.contracts.run_summary import RunSummary


def finish(run: RunDir, outcome, session_seconds: float, echo=print) -> tuple[RunSummary, Path | None]:
    """The session's summary (and report, when written). A folder that cannot take them (a full disk) does not
    hide the outcome: `echo` says what was not written, and the caller still reports the outcome."""
    from primebuild.runtime.report import summary_of, write_report

    record = run.read_json(run.run_record)
    previous = RunSummary.read(run.summary)
    extra = {"sft": record.get("model_info", {}), "model_seconds": record.get("model_seconds"),
             "wall_seconds": round(previous.wall_seconds + session_seconds, 2),
             "outcome": outcome.message}
    summary = summary_of(run, extra)
    try:
        write_json_atomic(run.outcome, OutcomeRecord(ok=outcome.ok, message=outcome.message,
                                                     exit_code=outcome.exit_code).model_dump(mode="json"))
        summary.write(run.summary)
        return summary, write_report(run)
    except OSError as err:
        echo(f"warning: cannot write the run's summary in {run.root}: {err.strerror}")
        return summary, None
