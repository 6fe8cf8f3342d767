"""The kubernetes target's launch against an API server that refuses (primebuild/runtime/targets/kubernetes.py).

No cluster runs on these machines, so the `kubernetes` client is replaced by a stand-in that records what is
created and deleted and refuses what a test says; the objects themselves are validated against the real
schemas in tests/test_render.py."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from conftest import MANIFESTS

from primebuild.builders.plan import compile_plan
from primebuild.contracts.run_dir import RunDir
from primebuild.errors import UserError
from primebuild.manifest.load import load_manifest


class ApiException(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def stand_in(refuse: str | None, states: list | None = None, pods: list | None = None
             ) -> tuple[types.ModuleType, list[str]]:
    """A `kubernetes` module whose API refuses creating `refuse` (a kind) with 404, answers the JobSet's state
    from `states` in turn ("running", "Completed", None for gone, or an exception to raise; the last one
    repeats), lists `pods`, and logs every call."""
    calls: list[str] = []
    answers = list(states or [None])

    class Core:
        def list_namespaced_pod(self, namespace, label_selector):
            calls.append("list pods")
            return types.SimpleNamespace(items=pods or [])

        def read_namespaced_pod_log(self, pod, namespace, container):
            calls.append(f"log {pod} {container}")
            return f"the log of {pod}/{container}\n"

        def __getattr__(self, method: str):
            def call(*args, **kwargs):
                kind = method.rsplit("_namespaced_", 1)[1]
                calls.append(f"{method.split('_')[0]} {kind}")
                if method.startswith("create") and kind == (refuse or "").lower():
                    raise ApiException(404, "Not Found")
            return call

    class Custom:
        def create_namespaced_custom_object(self, *args):
            calls.append("create jobset")
            if refuse == "JobSet":
                raise ApiException(404, "Not Found")

        def get_namespaced_custom_object(self, *args):
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(answer, BaseException):
                raise answer
            if answer is None:
                raise ApiException(404, "Not Found")
            ended = [] if answer == "running" else [{"type": answer, "status": "True", "message": "jobs done"}]
            return {"status": {"conditions": ended}}

        def delete_namespaced_custom_object(self, *args, **kwargs):
            calls.append("delete jobset")

    client = types.SimpleNamespace(CoreV1Api=Core, CustomObjectsApi=Custom, V1Secret=lambda **kw: kw,
                                   V1ObjectMeta=lambda **kw: kw,
                                   exceptions=types.SimpleNamespace(ApiException=ApiException))
    module = types.ModuleType("kubernetes")
    module.client = client
    module.config = types.SimpleNamespace(load_kube_config=lambda: None)
    return module, calls


def _run(tmp_path: Path, model_path: str) -> tuple[RunDir, object]:
    plan = compile_plan(load_manifest(MANIFESTS / "reverse-text.yaml", ["target={kind: kubernetes}"]))
    run = RunDir(tmp_path / "runs" / "r")
    run.root.mkdir(parents=True)
    (run.root / "plan.json").write_text(json.dumps(plan.to_json()))
    run.run_record.write_text(json.dumps({"model_path": model_path}))
    return run, plan


def test_a_refused_jobset_deletes_what_was_applied_before_it(tmp_path, monkeypatch):
    """The JobSet CRD missing (404): the Secret, ConfigMap and Service stayed applied, no launch record named
    them, and the next try met 409 AlreadyExists."""
    from primebuild.runtime.targets.kubernetes import KubernetesTarget

    module, calls = stand_in("JobSet")
    monkeypatch.setitem(sys.modules, "kubernetes", module)
    run, plan = _run(tmp_path, str(tmp_path / "runs" / "r" / "model"))
    with pytest.raises(UserError, match="refused JobSet/reverse-text in namespace default: 404 Not Found"):
        KubernetesTarget().launch(run, plan, echo=lambda _: None, verbosity=0)
    created = [c.split()[1] for c in calls if c.startswith("create")]
    deleted = [c.split()[1] for c in calls if c.startswith("delete")]
    assert created == ["secret", "config_map", "service", "jobset"]
    assert deleted == ["service", "config_map", "secret"]  # in reverse, the refused JobSet not among them


def test_a_model_the_pods_cannot_see_is_refused_before_anything_is_applied(tmp_path, monkeypatch):
    from primebuild.runtime.targets.kubernetes import KubernetesTarget

    module, calls = stand_in(None)
    monkeypatch.setitem(sys.modules, "kubernetes", module)
    run, plan = _run(tmp_path, "/elsewhere/store/abc-reverse-text-sft")
    with pytest.raises(UserError, match="cannot read the model at /elsewhere/store"):
        KubernetesTarget().launch(run, plan, echo=lambda _: None, verbosity=0)
    assert calls == []


def test_follow_says_what_keeps_a_pod_from_running(tmp_path, monkeypatch):
    """An image that cannot be pulled or a missing Secret leaves the JobSet "running" for ever: follow was
    silent. It says each trouble once; the run then ends with the JobSet (here: deleted)."""
    import primebuild.runtime.targets.kubernetes as target
    from primebuild.contracts.run_dir import LaunchRecord

    module, _ = stand_in(None)
    ns = types.SimpleNamespace
    waiting = ns(reason="ImagePullBackOff", message="Back-off pulling image \"primebuild:latest\"")
    pod = ns(metadata=ns(name="reverse-text-inference-0-0-x"), spec=ns(containers=[ns(name="p0")]), status=ns(
        phase="Pending", container_statuses=[ns(name="p0", ready=False, restart_count=0, state=ns(waiting=waiting))], init_container_statuses=None,
        conditions=[ns(type="PodScheduled", status="True", reason=None, message=None)]))
    polls = iter(["running", "running", "running", None])
    module.client.CoreV1Api.list_namespaced_pod = lambda self, *a, **kw: ns(items=[pod])
    module.client.CoreV1Api.read_namespaced_pod_log = lambda self, *a, **kw: ""
    monkeypatch.setitem(sys.modules, "kubernetes", module)
    monkeypatch.setattr(target, "POLL_SECONDS", 0.0)
    monkeypatch.setattr(target.KubernetesTarget, "_jobset_state", lambda self, namespace, name: next(polls))
    run, _ = _run(tmp_path, str(tmp_path / "runs" / "r" / "model"))
    said: list[str] = []
    outcome = target.KubernetesTarget().follow(run, LaunchRecord(target="kubernetes", namespace="default"),
                                               echo=said.append, verbosity=0)
    assert said == ['warning: pod reverse-text-inference-0-0-x, container p0: ImagePullBackOff (Back-off pulling '
                    'image "primebuild:latest")']
    assert not outcome.ok and "deleted" in outcome.message


def _pod(name: str, restarts: int = 0, ready: bool = True):
    ns = types.SimpleNamespace
    status = ns(name="p0", ready=ready, restart_count=restarts, state=ns(waiting=None))
    return ns(metadata=ns(name=name), spec=ns(containers=[ns(name="p0")]), status=ns(
        phase="Running", container_statuses=[status], init_container_statuses=None, conditions=[]))


APPLIED = ["Secret/reverse-text-admin", "ConfigMap/reverse-text-plan", "Service/reverse-text", "JobSet/reverse-text"]


def _follow(tmp_path, monkeypatch, states: list, pods: list):
    """follow() of a run whose JobSet answers `states` in turn; what it said, its outcome, the API calls."""
    import primebuild.runtime.targets.kubernetes as target
    import primebuild.runtime.targets.stopping as stopping
    from primebuild.contracts.run_dir import LaunchRecord

    module, calls = stand_in(None, states, pods)
    monkeypatch.setitem(sys.modules, "kubernetes", module)
    monkeypatch.setattr(target, "POLL_SECONDS", 0.0)
    monkeypatch.setattr(stopping, "POLL_SECONDS", 0.0)
    run, _ = _run(tmp_path, str(tmp_path / "runs" / "r" / "model"))
    said: list[str] = []
    record = LaunchRecord(target="kubernetes", namespace="default", objects=APPLIED)
    outcome = target.KubernetesTarget().follow(run, record, echo=said.append, verbosity=0)
    return run, said, outcome, calls


def test_a_hang_deletes_the_jobset_naming_its_pods_after_copying_their_logs(tmp_path, monkeypatch):
    """No step for longer than the hang bound: on other targets the supervisor ends the run; on Kubernetes
    `primebuild run` is the supervisor, and --hang-timeout had no effect there (the run sat for ever)."""
    import itertools

    import primebuild.runtime.targets.kubernetes as target
    from primebuild.runtime.hang_watchdog import HangWatchdog

    ticks = itertools.count(0, 60.0)  # every look at the clock: a minute later
    monkeypatch.setattr(target, "HangWatchdog", lambda *a, **kw: HangWatchdog(*a, **kw, clock=lambda: next(ticks)))
    pods = [_pod("reverse-text-trainer-0-0-abcde"), _pod("reverse-text-inference-0-0-fghij", restarts=2)]
    run, said, outcome, calls = _follow(tmp_path, monkeypatch, ["running"], pods)
    assert not outcome.ok and outcome.exit_code == 1
    assert outcome.message.startswith("hang: step 1 made no progress for "), outcome.message
    assert ("pods: reverse-text-trainer-0-0-abcde Running: p0 ready, 0 restarts; reverse-text-inference-0-0-fghij "
            "Running: p0 ready, 2 restarts") in outcome.message
    assert (run.stacks / "hang.txt").is_file()  # what it knows: no process of the run on this host
    assert (run.logs / "pod-reverse-text-inference-0-0-fghij-p0.log").read_text() == \
        "the log of reverse-text-inference-0-0-fghij/p0\n"
    assert calls[-4:] == ["delete jobset", "delete service", "delete config_map", "delete secret"]


def test_pods_still_starting_are_no_hang(tmp_path, monkeypatch):
    """A pod Pending (unscheduled, pulling a large image) is start-up, which can take longer than any bound."""
    import itertools

    import primebuild.runtime.targets.kubernetes as target
    from primebuild.runtime.hang_watchdog import HangWatchdog

    ticks = itertools.count(0, 60.0)
    monkeypatch.setattr(target, "HangWatchdog", lambda *a, **kw: HangWatchdog(*a, **kw, clock=lambda: next(ticks)))
    pending = _pod("reverse-text-trainer-0-0-abcde", ready=False)
    pending.status.phase = "Pending"
    _, _, outcome, _ = _follow(tmp_path, monkeypatch, ["running"] * 200 + ["Completed"], [pending])
    assert outcome.ok, outcome.message  # 200 polls, a minute apart each: no hang declared


def test_ctrl_c_stops_the_jobset_as_primebuild_stop_does(tmp_path, monkeypatch):
    """Ctrl-C of an attached follower left the JobSet running with nobody following it (the watchdog was told
    "done"). Now: STOP on the shared volume, the trainer checkpoints, the JobSet completes, logs copied, deleted;
    an API server that stops answering meanwhile is waited out, said once."""
    from primebuild.runtime.targets.kubernetes import KubernetesUnanswered

    pods = [_pod("reverse-text-trainer-0-0-abcde")]
    states = [KeyboardInterrupt(), KubernetesUnanswered("the API server answered 503 Service Unavailable"),
              KubernetesUnanswered("the API server answered 503 Service Unavailable"), "running", "Completed"]
    run, said, outcome, calls = _follow(tmp_path, monkeypatch, states, pods)
    assert outcome.exit_code == 130 and "interrupted" in outcome.message, outcome.message
    assert run.stop_requested()
    assert said[0].startswith("stopping: the trainer checkpoints")
    assert [line for line in said if line.startswith("warning")] == [
        "warning: the API server answered 503 Service Unavailable; asking again (the run's state unknown for 0 s)"]
    assert said[-1] == (f"1 pod logs copied into {run.logs}; deleted JobSet/reverse-text, Service/reverse-text, "
                        "ConfigMap/reverse-text-plan, Secret/reverse-text-admin")
    assert (run.logs / "pod-reverse-text-trainer-0-0-abcde-p0.log").is_file()


def test_api_errors_that_mean_no_answer_are_unanswered_not_internal_errors(tmp_path, monkeypatch):
    from urllib3.exceptions import MaxRetryError

    from primebuild.runtime.targets.base import TargetUnanswered
    from primebuild.runtime.targets.kubernetes import KubernetesTarget

    for error in (ApiException(503, "Service Unavailable"), ApiException(0, "timed out"), TimeoutError("read"),
                  MaxRetryError(None, "/apis/jobset.x-k8s.io", reason="connection refused")):
        module, _ = stand_in(None, [error])
        monkeypatch.setitem(sys.modules, "kubernetes", module)
        with pytest.raises(TargetUnanswered, match="JobSet default/reverse-text"):
            KubernetesTarget()._jobset_state("default", "reverse-text")
    module, _ = stand_in(None, [ApiException(403, "Forbidden")])  # an answer: no
    monkeypatch.setitem(sys.modules, "kubernetes", module)
    with pytest.raises(ApiException):
        KubernetesTarget()._jobset_state("default", "reverse-text")


def test_stop_of_a_detached_run_that_ended_collects_its_pods_and_deletes_it(tmp_path, monkeypatch, capsys):
    """A detached run's JobSet completes with nobody following: its pods (and logs) stay until `primebuild stop`."""
    from primebuild.cli import main
    from primebuild.contracts.run_dir import LaunchRecord

    module, calls = stand_in(None, ["Completed"], [_pod("reverse-text-orchestrator-0-0-abcde")])
    monkeypatch.setitem(sys.modules, "kubernetes", module)
    run, _ = _run(tmp_path, str(tmp_path / "runs" / "r" / "model"))
    run.launch_record.write_text(LaunchRecord(target="kubernetes", namespace="default",
                                              objects=APPLIED).model_dump_json())
    assert main(["stop", str(run.root), "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert f"1 pod logs copied into {run.logs}; deleted JobSet/reverse-text" in out, out
    assert (run.logs / "pod-reverse-text-orchestrator-0-0-abcde-p0.log").is_file()
    assert "delete jobset" in calls


def test_detach_is_refused_where_nothing_would_watch_for_hangs(tmp_path, capsys):
    from primebuild.cli import main

    code = main(["run", str(MANIFESTS / "reverse-text.yaml"), "--set", "target={kind: kubernetes}", "--detach",
                 "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and "--detach: on the kubernetes target `primebuild run` is what watches the run" in err, err
    assert "--hang-timeout 0" in err
    assert not (tmp_path / "runs").exists()  # refused before anything was built or written


def test_the_init_container_renames_its_copies_into_place(tmp_path):
    """Every pod copies rendezvous.json and plan.json into the shared run folder while other pods' workers may
    read them: a plain `cp` over the file could be read half-written."""
    import subprocess

    from primebuild.builders.render.kubernetes import PLAN_MOUNT, KubernetesObjects
    from primebuild.contracts.render import RenderContext

    plan = compile_plan(load_manifest(MANIFESTS / "reverse-text.yaml", ["target={kind: kubernetes}"]))
    run_dir = tmp_path / "runs" / "it's $(a) run"
    objects = KubernetesObjects(plan, RenderContext(run_dir=str(run_dir), python="python3",
                                                    model_path=str(tmp_path / "runs" / "m")))
    jobset = objects.objects()[2]
    init = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["initContainers"][0]
    mount = tmp_path / "etc"
    mount.mkdir()
    (mount / "rendezvous.json").write_text('{"hosts": []}')
    (mount / "plan.json").write_text("{}")
    command = [part.replace(PLAN_MOUNT, str(mount)) for part in init["command"]]
    done = subprocess.run(command, env={"HOSTNAME": "pod-0", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["plan.json", "rendezvous.json"]  # no copy left aside
    assert (run_dir / "rendezvous.json").read_text() == '{"hosts": []}'
    assert "mv -f" in init["command"][-1]
