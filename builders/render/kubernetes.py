"""Render a plan for Kubernetes: a ConfigMap holding the plan, a headless Service, one JobSet and, for
inference groups whose replicas span several nodes, a LeaderWorkerSet each. Pure; YAML built as data
and dumped (never templated text), so every value is escaped by the YAML emitter.

- JobSet (jobset.x-k8s.io/v1alpha2): one replicated job per group of the plan (builders/render/groups.py)
  in start order, `startupPolicy: InOrder` (a group starts once the previous one is ready: inference
  pods have a readiness probe on /health); `failurePolicy.maxRestarts: 0` — any failed job fails the
  whole JobSet and Kubernetes stops every pod (fail fast); `successPolicy: All` of trainer and
  orchestrator. A job has one pod per plan node of its group (Indexed completions; the pod with
  JOB_COMPLETION_INDEX r holds the r-th node's processes, one container each). Restart policies map
  to the Job's backoffLimit (inference: on-failure, trainer/orchestrator: never).
- A server must stay alive, not only get ready: a livenessProbe on /health (after a startupProbe that
  allows the plan's start timeout) has the kubelet restart a server whose engine died behind a live
  HTTP server (vLLM's /health answers 503 then), as the supervisor does elsewhere (runtime/liveness.py).
- LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): a multi-node inference replica is a group of `size`
  pods, recreated together (`RecreateGroupOnPodRestart`), the leader being node rank 0.
- Addresses: `{host:N}` is the DNS name of the pod that holds plan node N (JobSet:
  `<name>-<group>-0-<r>.<name>`; LeaderWorkerSet: `<lws>-<i>[-<w>].<lws>`), written into the rendezvous
  that the ConfigMap carries and an init container copies into the run folder; servers bind the pod's
  own address (`{bind:N}` resolves the pod's DNS name on the pod).
- Storage: the run folder (and the model folder) live on a ReadWriteMany PersistentVolumeClaim named
  `primebuild-runs`, mounted at the run folder's parent, the same path as where `primebuild run` runs.
- Secrets by name only: each is read from the Secret `<name>-secrets` (key = the variable's name); the
  run's admin token from `<name>-admin` (key `token`), which `primebuild run` creates at apply time.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex

import yaml

from primebuild import __version__
from primebuild.builders.render.groups import (
    Component,
    components,
    env_literals,
    image_reference,
    not_runnable_notes,
)
from primebuild.contracts.inference import ADMIN_TOKEN_ENV
from primebuild.contracts.plan import Plan, ProcessSpec, render_json
from primebuild.contracts.render import RenderContext

FILE_NAME = "kubernetes.yaml"
PVC_NAME = "primebuild-runs"
PLAN_MOUNT = "/etc/primebuild"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
LWS_API = "leaderworkerset.x-k8s.io/v1"
DEFAULT_IMAGE = "primebuild:latest"  # `primebuild build`'s image, pushed where the cluster pulls from


_NODE_RANK = re.compile(r"^(?P<base>.+-(?P<replica>\d+))-n(?P<rank>\d+)$")


def _multi_node_replicas(c: Component) -> dict[int, list[ProcessSpec]]:
    """Inference replicas of this component that span nodes (processes `<group>-<i>-n<rank>`):
    replica index -> its processes in node-rank order."""
    replicas: dict[int, list[ProcessSpec]] = {}
    for p in c.processes:
        match = _NODE_RANK.match(p.name)
        if p.role in ("inference", "prefill", "decode") and match:
            replicas.setdefault(int(match["replica"]), []).append(p)
    return {i: sorted(ps, key=lambda p: int(_NODE_RANK.match(p.name)["rank"])) for i, ps in sorted(replicas.items())}


class _Renderer:
    def __init__(self, plan: Plan, ctx: RenderContext):
        self.plan, self.ctx = plan, ctx
        self.name = plan.name.lower().replace("_", "-").replace(".", "-")
        self.namespace = plan.target.get("namespace", "default")
        self.image = image_reference(ctx.image, plan) or DEFAULT_IMAGE
        self.comps = components(plan)
        self.lws = {c.group: _multi_node_replicas(c) for c in self.comps}

    # --- addresses ---------------------------------------------------------------------------------

    def lws_name(self, group: str) -> str:
        return f"{self.name}-{group}"

    def hosts(self) -> list[str]:
        """Plan node N -> the DNS name of the pod holding it (the listening one, where two groups share N)."""
        owner: dict[int, tuple[bool, str]] = {}

        def claim(node: int, listening: bool, host: str) -> None:
            if node not in owner or (listening and not owner[node][0]):
                owner[node] = (listening, host)

        for c in self.comps:
            lws = self.lws_name(c.group)
            for replica, procs in self.lws[c.group].items():
                for rank, p in enumerate(procs):
                    claim(p.node, bool(p.ports), f"{lws}-{replica}" + (f"-{rank}" if rank else "") + f".{lws}")
            nodes = self.job_nodes(c)
            for p in self.job_processes(c):
                claim(p.node, bool(p.ports), f"{self.name}-{c.group}-0-{nodes.index(p.node)}.{self.name}")
        return [owner[n][1] if n in owner else f"unallocated-node-{n}" for n in range(self.plan.hardware["nodes"])]

    def job_processes(self, c: Component) -> list[ProcessSpec]:
        in_lws = {p.name for procs in self.lws[c.group].values() for p in procs}
        return [p for p in c.processes if p.name not in in_lws]

    def job_nodes(self, c: Component) -> list[int]:
        return sorted({p.node for p in self.job_processes(c)})

    # --- pods --------------------------------------------------------------------------------------

    def container(self, p: ProcessSpec, index: int) -> dict:
        env = [{"name": k, "value": v} for k, v in env_literals(p).items()]
        env.append({"name": "PRIMEBUILD_RUN_DIR", "value": self.ctx.run_dir})
        env.append({"name": ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": f"{self.name}-admin",
                                                                            "key": "token"}}})
        env += [{"name": s, "valueFrom": {"secretKeyRef": {"name": f"{self.name}-secrets", "key": s}}}
                for s in p.secrets]
        container = {
            "name": f"p{index}", "image": self.image, "env": env,
            "command": [self.ctx.python, "-m", "primebuild.cli", "worker", "--plan", f"{PLAN_MOUNT}/plan.json",
                        "--process", p.name, "--run-dir", self.ctx.run_dir],
            "volumeMounts": [{"name": "runs", "mountPath": posixpath.dirname(self.ctx.run_dir)},
                             {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True}],
        }
        resources = {"nvidia.com/gpu": str(len(p.gpus))} if p.gpus else {"cpu": p.env.get("OMP_NUM_THREADS", "1")}
        container["resources"] = {"limits": resources} if p.gpus else {"requests": resources}
        if "http" in p.ports:
            container["ports"] = [{"name": "http", "containerPort": p.ports["http"]}]
            def probe(**timing) -> dict:  # a fresh dict each: shared ones would become YAML anchors
                return {"httpGet": {"path": "/health", "port": p.ports["http"]}, **timing}

            container["readinessProbe"] = probe(periodSeconds=5, failureThreshold=360)
            container["startupProbe"] = probe(periodSeconds=5, failureThreshold=max(1, round(p.health.timeout_s / 5)))
            container["livenessProbe"] = probe(periodSeconds=5, timeoutSeconds=5, failureThreshold=6)
        return container

    def pod_spec(self, processes: list[ProcessSpec], restart: str, by_index: bool) -> dict:
        """One container per process on this node; `by_index`: the pod picks its node by
        JOB_COMPLETION_INDEX (all pods of a job share one template)."""
        spec: dict = {"restartPolicy": restart, "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": PVC_NAME}},
            {"name": "plan", "configMap": {"name": f"{self.name}-plan"}}]}
        if self.plan.target.get("service_account"):
            spec["serviceAccountName"] = self.plan.target["service_account"]
        copy = f"mkdir -p {shlex.quote(self.ctx.run_dir)} && cp {PLAN_MOUNT}/rendezvous.json " \
               f"{shlex.quote(self.ctx.run_dir)}/rendezvous.json && cp {PLAN_MOUNT}/plan.json " \
               f"{shlex.quote(self.ctx.run_dir)}/plan.json"
        spec["initContainers"] = [{"name": "rendezvous", "image": self.image, "command": ["sh", "-c", copy],
                                   "volumeMounts": [{"name": "runs",
                                                     "mountPath": posixpath.dirname(self.ctx.run_dir)},
                                                    {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True}]}]
        if not by_index:
            spec["containers"] = [self.container(p, i) for i, p in enumerate(processes)]
            return spec
        nodes = sorted({p.node for p in processes})
        per_node = [[p for p in processes if p.node == n] for n in nodes]
        width = max(len(group) for group in per_node)
        containers = []
        for slot in range(width):
            first = next(group[slot] for group in per_node if len(group) > slot)
            container = self.container(first, slot)
            choices = " ".join(f"{rank}) exec \"$0\" \"$@\" --process {shlex.quote(g[slot].name)} ;;"
                               for rank, g in enumerate(per_node) if len(g) > slot)
            if len(per_node) > 1:  # which node's process: by the pod's index
                argv = [a for a in container["command"]]
                i = argv.index("--process")
                del argv[i:i + 2]
                container["command"] = ["sh", "-c", f'case "$JOB_COMPLETION_INDEX" in {choices} '
                                        '*) echo "no process for index $JOB_COMPLETION_INDEX" >&2; exit 2 ;; esac',
                                        *argv]
            containers.append(container)
        spec["containers"] = containers
        return spec

    # --- objects -----------------------------------------------------------------------------------

    def labels(self, group: str) -> dict:
        return {"app.kubernetes.io/name": "primebuild", "app.kubernetes.io/instance": self.name,
                "primebuild.dev/group": group}

    def objects(self) -> list[dict]:
        meta = {"namespace": self.namespace, "labels": {"app.kubernetes.io/name": "primebuild",
                                                        "app.kubernetes.io/instance": self.name}}
        rendezvous = {"hosts": self.hosts(), "model_path": self.ctx.model_path}
        config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{self.name}-plan", **meta},
                  "data": {"plan.json": render_json(self.plan),
                           "rendezvous.json": json.dumps(rendezvous, indent=2, sort_keys=True) + "\n"}}
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": self.name, **meta},
                   "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                            "selector": {"jobset.sigs.k8s.io/jobset-name": self.name}}}
        jobs, lws_objects = [], []
        for c in self.comps:
            procs = self.job_processes(c)
            if procs:
                never = all(p.restart.policy == "never" for p in procs)
                backoff = 0 if never else max(p.restart.max_restarts for p in procs)
                n = len(self.job_nodes(c))
                jobs.append({"name": c.group, "replicas": 1, "template": {"spec": {
                    "parallelism": n, "completions": n, "completionMode": "Indexed", "backoffLimit": backoff,
                    "template": {"metadata": {"labels": self.labels(c.group)},
                                 "spec": self.pod_spec(procs, "Never" if never else "OnFailure", by_index=True)}}}})
            for rprocs in list(self.lws[c.group].values())[:1]:
                # every replica has the same shape: one LeaderWorkerSet, `replicas` of them
                lws = self.lws_name(c.group)
                count = len(self.lws[c.group])
                leader = self.pod_spec([rprocs[0]], "Always", by_index=False)
                worker = self.pod_spec([rprocs[1]], "Always", by_index=False)
                for spec in (leader, worker):  # replica i runs <group>-i-nK: chosen by the group index
                    for container in spec["containers"]:
                        argv = container["command"]
                        i = argv.index("--process")
                        rank = argv[i + 1].rpartition("-n")[2]
                        del argv[i:i + 2]
                        container["command"] = ["sh", "-c", "exec \"$0\" \"$@\" --process "
                                                f"{shlex.quote(c.group)}-\"$LWS_GROUP_INDEX\"-n{rank}", *argv]
                        container["env"].append({"name": "LWS_GROUP_INDEX", "valueFrom": {"fieldRef": {
                            "fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"}}})
                lws_objects.append({"apiVersion": LWS_API, "kind": "LeaderWorkerSet",
                                    "metadata": {"name": lws, **meta}, "spec": {
                                        "replicas": count, "startupPolicy": "LeaderCreated",
                                        "networkConfig": {"subdomainPolicy": "Shared"},
                                        "leaderWorkerTemplate": {
                                            "size": len(rprocs), "restartPolicy": "RecreateGroupOnPodRestart",
                                            "leaderTemplate": {"metadata": {"labels": self.labels(c.group)},
                                                               "spec": leader},
                                            "workerTemplate": {"metadata": {"labels": self.labels(c.group)},
                                                               "spec": worker}}}})
        done = [c.group for c in self.comps if c.group in ("trainer", "orchestrator") and self.job_processes(c)]
        jobset = {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": {"name": self.name, **meta}, "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": self.name, "publishNotReadyAddresses": True},
            "startupPolicy": {"startupPolicyOrder": "InOrder"},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": done},
            "replicatedJobs": jobs}}
        return [config, service, *lws_objects, jobset]


def render_kubernetes(plan: Plan, ctx: RenderContext) -> dict[str, str]:
    objects = _Renderer(plan, ctx).objects()
    header = [f"# primebuild {__version__}: {plan.name}, plan {plan.plan_hash}, target kubernetes "
              "(rendered; do not edit)"] + [f"# {n}" for n in not_runnable_notes(plan)]
    text = "\n".join(header) + "\n" + "".join(
        "---\n" + yaml.safe_dump(o, sort_keys=False, default_flow_style=False, width=120) for o in objects)
    return {FILE_NAME: text}


def kubernetes_objects(plan: Plan, ctx: RenderContext) -> list[dict]:
    return _Renderer(plan, ctx).objects()
