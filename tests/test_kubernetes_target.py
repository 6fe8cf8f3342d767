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


def stand_in(refuse: str | None) -> tuple[types.ModuleType, list[str]]:
    """A `kubernetes` module whose API refuses creating `refuse` (a kind) with 404, and a log of calls."""
    calls: list[str] = []

    class Core:
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
        container_statuses=[ns(name="p0", state=ns(waiting=waiting))], init_container_statuses=None,
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
