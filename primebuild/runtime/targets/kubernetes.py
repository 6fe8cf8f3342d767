"""The Kubernetes target: apply the rendered objects with the official client, follow the JobSet.

- provision: a kube context (`kubernetes.config.load_kube_config`, or in-cluster config); without one,
  `run` refuses and says to `primebuild render --target kubernetes` and apply by hand;
- launch: the rendezvous (the pods' DNS names) into the run folder, a Secret `<name>-admin` with a fresh
  admin token (created through the API, never rendered), then every object of
  primebuild/builders/render/kubernetes.py (ConfigMap, Service, JobSet), its pods running the image `run --image`
  names (recorded in the run; default primebuild:latest);
- follow: poll the JobSet's conditions (Completed / Failed) and print the progress lines from the run
  folder (metrics.jsonl, on the shared volume), and what keeps a pod from running (an image it cannot pull,
  a missing Secret, a crash loop, no node to take it: the JobSet stays "running" through those); watch for
  hangs as the supervisor does elsewhere (primebuild/runtime/hang_watchdog.py: no step for longer than the
  bound ends the run, naming the pods; their stacks are not taken, the processes are not on this host);
  Ctrl-C stops the run as `primebuild stop` does (STOP on the shared volume, its grace, then delete);
- stop: copy each pod's log into logs/, then delete what was applied (Kubernetes stops the pods); also when
  the JobSet ends, however it ends, so that `--resume` can create the objects again; a create the API refuses
  deletes what was applied before it;
- release: a detached run's ended JobSet keeps its pods until `primebuild stop` collects and deletes them;
- state: the JobSet's terminal condition, or "running".

No cluster runs on the CI machines: the rendered objects are validated there against the Kubernetes
and CRD schemas (tests/test_render.py), and this module runs against a stand-in of the `kubernetes` client
(tests/test_kubernetes_target.py: refusals, follow's warnings, hang, Ctrl-C, an unanswering API, stop).
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath

from primebuild.builders.render.kubernetes import JOBSET_API, KubernetesObjects, object_name
from primebuild.contracts.plan import Plan, read_plan
from primebuild.contracts.render import RenderContext
from primebuild.contracts.run_dir import LaunchRecord, Rendezvous, RunDir, write_json_atomic
from primebuild.errors import UserError
from primebuild.runtime.hang_watchdog import HangWatchdog
from primebuild.runtime.progress import Progress
from primebuild.runtime.supervisor import Outcome
from primebuild.runtime.targets.base import Echo, Target, TargetUnanswered
from primebuild.runtime.targets.stopping import UNANSWERED_NOTICE_SECONDS, own_end_seconds, stop_gracefully

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


class KubernetesUnanswered(TargetUnanswered):
    """The API server did not answer (a timeout, a 5xx, no connection): the JobSet's state is unknown."""


@contextmanager
def _asking(client, what: str) -> Iterator[None]:
    """An API call whose "no answer" (a timeout, a refused connection, a 5xx or 429) is KubernetesUnanswered;
    other answers (404, 403) pass through to the caller."""
    try:
        yield
    except client.exceptions.ApiException as err:
        if err.status in (None, 0, 429) or err.status >= 500:
            raise KubernetesUnanswered(f"the API server answered {err.status} {err.reason} {what}") from None
        raise
    except _no_answer() as err:
        raise KubernetesUnanswered(f"the API server did not answer {what}: {type(err).__name__}: {err}") from None


def _no_answer() -> tuple[type[BaseException], ...]:
    """What the client raises when the API server does not answer: urllib3's errors (a timeout, a refused
    connection, retries used up: not OSErrors) and the socket's own."""
    try:
        from urllib3.exceptions import HTTPError
    except ImportError:
        return (OSError,)
    return (OSError, HTTPError)


def _pod_troubles(pods: list) -> list[str]:
    """What keeps the run's pods from running, as Kubernetes reports it: a container waiting for a reason
    that does not pass by itself (an image it cannot pull, a missing Secret, a crash loop), or a pod no
    node can take."""
    troubles = []
    for pod in pods:
        for status in _container_statuses(pod):
            waiting = status.state.waiting if status.state else None
            if waiting is not None and waiting.reason in STUCK_REASONS:
                troubles.append(f"pod {pod.metadata.name}, container {status.name}: {waiting.reason}"
                                + (f" ({waiting.message})" if waiting.message else ""))
        for condition in pod.status.conditions or []:
            if condition.type == "PodScheduled" and condition.status == "False" and condition.reason:
                troubles.append(f"pod {pod.metadata.name} is not scheduled: {condition.reason}"
                                + (f" ({condition.message})" if condition.message else ""))
    return troubles


def _container_statuses(pod) -> list:
    return (pod.status.container_statuses or []) + (pod.status.init_container_statuses or [])


def _pod_signature(pods: list) -> tuple:
    """What changes when a container exits or restarts (the hang watchdog counts that as progress)."""
    return tuple(sorted((pod.metadata.name, status.name, status.restart_count or 0, bool(status.ready))
                        for pod in pods for status in _container_statuses(pod)))


def _pod_states(pods: list) -> list[str]:
    """One phrase per pod for a hang's message: its phase and each container's restarts and readiness."""
    return [f"{pod.metadata.name} {pod.status.phase}: " + ", ".join(
        f"{s.name} {'ready' if s.ready else 'not ready'}, {s.restart_count or 0} restarts"
        for s in pod.status.container_statuses or []) for pod in pods]


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
        """"Completed: …" / "Failed: …" / "running", or None when the JobSet is gone; KubernetesUnanswered when
        the API server did not say (a timeout, a 5xx, no connection)."""
        client = _client()
        group, version = _group_version(JOBSET_API)
        try:
            with _asking(client, f"about JobSet {namespace}/{name}"):
                jobset = client.CustomObjectsApi().get_namespaced_custom_object(group, version, namespace, "jobsets",
                                                                                name)
        except client.exceptions.ApiException as err:
            if err.status == 404:
                return None
            raise
        for condition in (jobset.get("status") or {}).get("conditions", []):
            if condition.get("type") in ("Completed", "Failed") and condition.get("status") == "True":
                return f"{condition['type']}: {condition.get('message', '')}".strip()
        return "running"

    def follow(self, run: RunDir, record: LaunchRecord, *, echo: Echo, verbosity: int) -> Outcome:
        """The JobSet to its end; Ctrl-C stops it as `primebuild stop` does (STOP, its grace, then delete)."""
        try:
            return self._follow(run, record, echo)
        except KeyboardInterrupt:
            echo("stopping: the trainer checkpoints, then the JobSet is deleted (Ctrl-C again to delete it now)")
            stop_gracefully(self, run, record, grace=own_end_seconds(), echo=echo, interruptible=True)
            return Outcome(False, f"interrupted: the JobSet is deleted; `primebuild run --resume {run.root}` "
                                  "continues after its newest checkpoint", 130)

    def _follow(self, run: RunDir, record: LaunchRecord, echo: Echo) -> Outcome:
        plan = read_plan(run.plan)  # read once: every poll asks about the same objects
        name, namespace = object_name(plan.name), record.namespace
        progress = Progress(run.metrics, echo)
        hang = HangWatchdog(plan, run, run.read_supervision().hang_floor_s)
        said: set[str] = set()
        told = float("-inf")
        while True:
            progress.poll()
            try:
                state = self._jobset_state(namespace, name)
                pods = self._pods(namespace, name)
            except TargetUnanswered as err:  # the pods run on without us: ask again, and say so
                if time.monotonic() - told >= UNANSWERED_NOTICE_SECONDS:
                    echo(f"warning: {err.problems[0].message}; asking again")
                    told = time.monotonic()
                time.sleep(POLL_SECONDS)
                continue
            if state != "running":
                break
            for trouble in _pod_troubles(pods):  # a JobSet stays "running" with pods that never start
                if trouble not in said:
                    said.add(trouble)
                    echo(f"warning: {trouble}")
            if any(pod.status.phase == "Pending" for pod in pods):  # scheduling, pulling the image: start-up
                hang.last_progress = hang.clock()
            hung = hang.check(progress.newest_trained_step(), _pod_signature(pods), progress.trained)
            if hung is not None:
                hung += f"; pods: {'; '.join(_pod_states(pods)) or 'none'}"
                self.stop(run, record)  # their logs into logs/, then the objects deleted
                return Outcome(False, hung, 1)
            time.sleep(POLL_SECONDS)
        progress.poll()
        self.stop(run, record)  # inference servers run until deleted; a resume creates the objects anew
        if state and state.startswith("Completed"):
            if run.stop_requested():
                return Outcome(True, f"stopped at step {progress.newest_trained_step()}; resume with "
                                     f"`primebuild run --resume {run.root}`", 0)
            return Outcome(True, "run complete", 0)
        return Outcome(False, f"JobSet {state or 'deleted'}; see {run.logs}", 1)

    def _pods(self, namespace: str | None, name: str) -> list:
        client = _client()
        with _asking(client, f"listing the pods of {namespace}/{name}"):
            return client.CoreV1Api().list_namespaced_pod(
                namespace, label_selector=f"app.kubernetes.io/instance={name}").items

    def _collect_logs(self, run: RunDir, namespace: str | None, name: str) -> int:
        """Each container's log into logs/pod-POD-CONTAINER.log (pod names are new each session); how many."""
        client = _client()
        core = client.CoreV1Api()
        run.logs.mkdir(parents=True, exist_ok=True)
        copied = 0
        for pod in self._pods(namespace, name):
            for container in pod.spec.containers:
                try:
                    text = core.read_namespaced_pod_log(pod.metadata.name, namespace, container=container.name)
                except client.exceptions.ApiException as err:
                    text = f"(no log: {err.reason})\n"
                (run.logs / f"pod-{pod.metadata.name}-{container.name}.log").write_text(text)
                copied += 1
        return copied

    def active(self, run: RunDir, record: LaunchRecord) -> bool:
        return self._jobset_state(record.namespace, _instance(run)) == "running"

    def stop(self, run: RunDir, record: LaunchRecord) -> str:
        """The pods' logs into logs/ (deleting the JobSet deletes them), then what was applied, in reverse."""
        client = _client()
        core, custom = client.CoreV1Api(), client.CustomObjectsApi()
        ns = record.namespace
        said = []
        jobsets = [ref.partition("/")[2] for ref in record.objects if ref.startswith("JobSet/")]
        if jobsets:  # only pods of a JobSet this run applied (a refused launch may meet an earlier run's)
            try:
                said.append(f"{self._collect_logs(run, ns, jobsets[0])} pod logs copied into {run.logs}")
            except (TargetUnanswered, client.exceptions.ApiException) as err:
                print(f"kubernetes: the pods' logs could not be copied: {err}", file=sys.stderr)
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
        said.append(f"deleted {', '.join(deleted)}" if deleted else "nothing of the run is left to delete")
        return "; ".join(said)

    def release(self, run: RunDir, record: LaunchRecord) -> str | None:
        return self.stop(run, record)  # an ended JobSet keeps its pods (and their logs) until deleted

    def state(self, run: RunDir, record: LaunchRecord) -> str:
        try:
            return f"kubernetes JobSet: {self._jobset_state(record.namespace, _instance(run)) or 'deleted'}"
        except UserError as err:
            return f"kubernetes: unknown ({err.problems[0].message})"
        except Exception as err:  # noqa: BLE001 (the API's own errors: 403, a timeout): status still answers
            return f"kubernetes: unknown ({type(err).__name__}: {err})"
