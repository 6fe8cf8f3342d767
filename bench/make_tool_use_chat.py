"""Write manifests/data/tool-use-chat.jsonl: tool-lookup demonstrations as a chat dataset.

Each row is the episode tool-use-sft.yaml learns from the environment, written out as messages: the
user's key, the assistant's `lookup` call, the tool's value, the assistant's answer; `tools` is what the
environment offers, so the chat template renders the same system prompt the orchestrator does.
Only training-side keys/values (never the held-out ones).

    python bench/make_tool_use_chat.py [--rows 512] [--seed 0] [--out manifests/data/tool-use-chat.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random

from primebuild.runtime.envs.base import MODEL
from primebuild.runtime.envs.tool_lookup import ToolLookupEnv


def rows(n: int, seed: int) -> list[dict]:
    env = ToolLookupEnv(key_length=0, num_eval=48)
    rng = random.Random(seed)
    out = []
    for task in env.sample_tasks(rng, n):
        messages = list(env.chat_messages(task))
        for by_model, segment in env.demonstration(task, rng):
            messages += [{"role": "assistant", "content": segment}] if by_model == MODEL else segment
        out.append({"messages": messages, "tools": env.chat_tools(task)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="manifests/data/tool-use-chat.jsonl")
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")  # key order kept: the template renders the tools as given


if __name__ == "__main__":
    main()
