"""The Kubernetes target: apply the rendered objects with the official client, follow the JobSet.

- provision: a kube context (`kubernetes.config.load_kube_config`, or in-cluster config); without one,
  `run` refuses and says to `primebuild render --target kubernetes` and apply by hand;
- launch: the rendezvous (the pods' DNS names) into the run folder, a Secret `<name>-admin` with a fresh
  admin token (created through the API, never rendered), then every object of
  primebuild/builders/render/kubernetes.py (ConfigMap, Service, JobSet), its pods running the image `run --image`
  names (recorded in the run; default primebuild:latest);
- follow: poll the JobSet's conditions (Completed / Failed) and print the progress lines from the run
  folder (metrics.jsonl, on the shared volume), and what keeps a pod from running (an image it cannot pull,
  a missing Secret, a crash loop, no node to take it: the JobSet stays "running" through those); at the end
  copy each pod's log into logs/;
- stop: delete what was applied (Kubernetes stops the pods); also when the JobSet ends, however it ends, so
  that `--resume` can create the objects again; a create the API refuses deletes what was applied before it;
- state: the JobSet's terminal condition, or "running".

No cluster runs on the CI machines: the rendered objects are validated there against the Kubernetes
and CRD schemas (tests/test_render.py), and this module is exercised only as far as its refusal.
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import PurePosixPath

from primebuild.builders.render.kubernetes import JOBSET_API, KubernetesObjects, object_name
from primebuild.contracts.plan import Plan, read_plan
from primebuild.contracts.render import RenderContext
from primebuild.contracts.run_dir import LaunchRecord, Rendezvous, RunDir, write_json_atomic
from primebuild.errors import UserError
from primebuild.runtime.progress import Progress
from primebuild.runtime.supervisor import Outcome
from primebuild.runtime.targets.base import Echo, Target

POLL_SECONDS = 5.0
# container waiting reasons that do not pass by themselves: follow says them (the JobSet stays "running")
STUCK_REASONS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError", "CrashLoopBackOff")
# The core v1 kinds a run applies, as the client's method names spell them (create_namespaced_config_map...);
# every other object is the JobSet, a custom object.
_CORE_KINDS = {"Secret": "secret", "ConfigMap": "config_map", "Service": "service"}


def _client():
    try:
        import kubernetes
    except ImportError:
        raise UserError("target kubernetes: the `kubernetes` package is not installed",
                        hint="pip install 'primebuild[kubernetes]', or `primebuild render --target kubernetes` "
                             "and kubectl apply the output") from None
    try:
        kubernetes.config.load_kube_config()
    except Exception:  # noqa: BLE001 (no kubeconfig, no current context: both mean "no cluster here")
        try:
            kubernetes.config.load_incluster_config()
        except Exception:  # noqa: BLE001
            raise UserError("target kubernetes: no kube context (no kubeconfig, not inside a cluster)",
                            hint="`primebuild render MANIFEST --target kubernetes` prints the objects to apply "
                                 "with kubectl") from None
    return kubernetes.client


def _instance(run: RunDir) -> str:
    """The name the run's objects and pods carry (the JobSet's, the pods' app.kubernetes.io/instance label)."""
    return object_name(read_plan(run.plan).name)


def _group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.partition("/")
    return group, version


class KubernetesTarget(Target):
    kind = "kubernetes"

    def provision(self, plan: Plan) -> None:
        _client()

    def _renderer(self, run: RunDir, plan: Plan) -> KubernetesObjects:
        record = run.read_json(run.run_record)
        return KubernetesObjects(plan, RenderContext(run_dir=str(run.root), python="python3", image=record.get("image"),
                                             model_path=record.get("model_path", "{model_path}")))

    def launch(self, run: RunDir, plan: Plan, *, echo: Echo, verbosity: int, live=None,
               avoid_hosts: tuple[str, ...] = ()) -> LaunchRecord:
        client = _client()
        renderer = self._renderer(run, plan)
        seen = PurePosixPath(renderer.ctx.run_dir).parent  # the runs volume, as the pods mount it
        if not PurePosixPath(renderer.ctx.model_path).is_relative_to(seen):
            raise UserError(f"target kubernetes: the pods mount {seen} (the runs volume) and no other folder of this "
                            f"machine, so they cannot read the model at {renderer.ctx.model_path}",
                            hint=f"keep the store on that volume (PRIMEBUILD_STORE under {seen}), or `primebuild "
                                 "render --target kubernetes --model-path` and apply it by hand")
        write_json_atomic(run.rendezvous, Rendezvous(**renderer.rendezvous()).model_dump(mode="json"))
        core, custom = client.CoreV1Api(), client.CustomObjectsApi()
        ns = renderer.namespace
        token = client.V1Secret(metadata=client.V1ObjectMeta(name=f"{renderer.name}-admin"),
                                string_data={"token": secrets.token_urlsafe(24)})
        applied: list[str] = []
        objects = [("Secret", f"{renderer.name}-admin", token)] + [
            (obj["kind"], obj["metadata"]["name"], obj) for obj in renderer.objects()]
        for kind, name, obj in objects:
            try:
                if kind in _CORE_KINDS:
                    getattr(core, f"create_namespaced_{_CORE_KINDS[kind]}")(ns, obj)
                else:
                    custom.create_namespaced_custom_object(*_group_version(JOBSET_API), ns, "jobsets", obj)
            except client.exceptions.ApiException as err:  # nothing half-applied stays behind
                self.stop(run, LaunchRecord(target=self.kind, namespace=ns, objects=applied))
                raise UserError(f"kubernetes refused {kind}/{name} in namespace {ns}: {err.status} {err.reason}; "
                                f"what was applied before it is deleted again",
                                hint="409: objects of an earlier run of this name are left (`kubectl delete` them, or "
                                     "set another name); 404: the JobSet CRD is not installed") from None
            applied.append(f"{kind}/{name}")
            echo(f"applied {kind}/{name} in namespace {ns}")
        return LaunchRecord(target=self.kind, namespace=ns, objects=applied)

    def _jobset_state(self, namespace: str | None, name: str) -> str | None:
        client = _client()
        group, version = _group_version(JOBSET_API)
        try:
            jobset = client.CustomObjectsApi().get_namespaced_custom_object(group, version, namespace, "jobsets", name)
        except client.exceptions.ApiException as err:
            if err.status == 404:
                return None
            raise
        for condition in (jobset.get("status") or {}).get("conditions", []):
            if condition.get("type") in ("Completed", "Failed") and condition.get("status") == "True":
                return f"{condition['type']}: {condition.get('message', '')}".strip()
        return "running"

    def follow(self, run: RunDir, record: LaunchRecord, *, echo: Echo, verbosity: int) -> Outcome:
        progress = Progress(run.metrics, echo)
        name = _instance(run)  # read once: every poll asks about the same objects
        said: set[str] = set()
        while True:
            progress.poll()
            state = self._jobset_state(record.namespace, name)
            if state is None or state != "running":
                break
            for trouble in self._pod_troubles(record.namespace, name):  # a JobSet stays "running" with pods that never start
                if trouble not in said:
                    said.add(trouble)
                    echo(f"warning: {trouble}")
            time.sleep(POLL_SECONDS)
        self._collect_logs(run, record.namespace, name)
        progress.poll()
        self.stop(run, record)  # inference servers run until deleted; a resume creates the objects anew
        if state and state.startswith("Completed"):
            return Outcome(True, "run complete", 0)
        return Outcome(False, f"JobSet {state or 'deleted'}; see {run.logs}", 1)

    def _pod_troubles(self, namespace: str | None, name: str) -> list[str]:
        """What keeps the run's pods from running, as Kubernetes reports it: a container waiting for a reason
        that does not pass by itself (an image it cannot pull, a missing Secret, a crash loop), or a pod no
        node can take."""
        client = _client()
        pods = client.CoreV1Api().list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={name}")
        troubles = []
        for pod in pods.items:
            for status in (pod.status.container_statuses or []) + (pod.status.init_container_statuses or []):
                waiting = status.state.waiting if status.state else None
                if waiting is not None and waiting.reason in STUCK_REASONS:
                    troubles.append(f"pod {pod.metadata.name}, container {status.name}: {waiting.reason}"
                                    + (f" ({waiting.message})" if waiting.message else ""))
            for condition in pod.status.conditions or []:
                if condition.type == "PodScheduled" and condition.status == "False" and condition.reason:
                    troubles.append(f"pod {pod.metadata.name} is not scheduled: {condition.reason}"
                                    + (f" ({condition.message})" if condition.message else ""))
        return troubles

    def _collect_logs(self, run: RunDir, namespace: str | None, name: str) -> None:
        client = _client()
        core = client.CoreV1Api()
        run.logs.mkdir(parents=True, exist_ok=True)
        pods = core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={name}")
        for pod in pods.items:
            for container in pod.spec.containers:
                try:
                    text = core.read_namespaced_pod_log(pod.metadata.name, namespace, container=container.name)
                except client.exceptions.ApiException as err:
                    text = f"(no log: {err.reason})\n"
                (run.logs / f"pod-{pod.metadata.name}-{container.name}.log").write_text(text)

    def active(self, run: RunDir, record: LaunchRecord) -> bool:
        return self._jobset_state(record.namespace, _instance(run)) == "running"

    def stop(self, run: RunDir, record: LaunchRecord) -> str:
        client = _client()
        core, custom = client.CoreV1Api(), client.CustomObjectsApi()
        ns = record.namespace
        deleted = []
        for ref in reversed(record.objects):
            kind, _, name = ref.partition("/")
            try:
                if kind in _CORE_KINDS:
                    getattr(core, f"delete_namespaced_{_CORE_KINDS[kind]}")(name, ns)
                else:
                    custom.delete_namespaced_custom_object(*_group_version(JOBSET_API), ns, "jobsets", name,
                                                           propagation_policy="Foreground")
                deleted.append(ref)
            except client.exceptions.ApiException as err:
                if err.status != 404:
                    print(f"kubernetes: could not delete {ref}: {err.reason}", file=sys.stderr)
        return f"deleted {', '.join(deleted)}" if deleted else "nothing of the run was applied"

    def state(self, run: RunDir, record: LaunchRecord) -> str:
        try:
            return f"kubernetes JobSet: {self._jobset_state(record.namespace, _instance(run)) or 'deleted'}"
        except UserError as err:
            return f"kubernetes: unknown ({err.problems[0].message})"
        except Exception as err:  # noqa: BLE001 (the API's own errors: 403, a timeout): status still answers
            return f"kubernetes: unknown ({type(err).__name__}: {err})"
