"""The vLLM P/D router's bookkeeping of ExampleConnector's KV folders (primebuild/runtime/inference/vllm/kv_files.py):
names as vLLM computes them, deleted only when no request holds them and no prefill may be writing."""

from __future__ import annotations

import hashlib

from primebuild.runtime.inference.vllm.kv_files import KvFiles, folder_names


def md5_of(ids: list[int]) -> str:
    return hashlib.md5(b"".join(i.to_bytes(8, "little", signed=True) for i in ids)).hexdigest()


def test_names_are_the_whole_blocks_a_prompt_is_stored_and_looked_up_under():
    ids = list(range(3, 47))  # 44 tokens: stored and looked up as its first 32
    assert folder_names(ids, 32) == {md5_of(ids[:32])}
    ids = list(range(3, 36))  # 33 tokens: stored as 32, looked up as none (vLLM's off-by-one block)
    assert folder_names(ids, 32) == {md5_of(ids[:32]), md5_of([])}


def test_a_folder_goes_when_its_last_holder_is_done_and_no_prefill_is_in_flight(tmp_path):
    files = KvFiles(tmp_path, 32)
    a, b = {"a"}, {"b"}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "layer.safetensors").write_bytes(b"kv")
    files.hold(a)
    files.hold(a)
    files.release(a)
    assert (tmp_path / "a").exists()  # one holder left
    files.begin_write()  # a prefill in flight may be writing any folder
    files.release(a)
    assert (tmp_path / "a").exists()
    files.end_write()
    assert not (tmp_path / "a").exists() and (tmp_path / "b").exists() and files.deleted == 1
    files.hold(b)
    files.wipe()  # after a weight update: held or not, every file is the old policy's
    assert files.folders() == 0
    files.release(b)  # a re-created folder of a released name goes too
    assert files.folders() == 0
