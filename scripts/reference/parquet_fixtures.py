"""Parquet twins of a JSONL chat dataset, written as Hugging Face `datasets`
writes them (pyarrow, snappy, a list-of-struct chat column), for
tests/tests/inputs.rs. Reference code for tests only.

    python parquet_fixtures.py IN.jsonl OUT_DIR

writes OUT_DIR/messages.parquet (the lines' OpenAI `messages`, plus `id` and
`category` columns), OUT_DIR/conversations.parquet (the same turns in
ShareGPT form), and two broken files: wrong_column.parquet (the chat column
named `turns`) and wrong_types.parquet (`content` holds integers).
"""
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq

src, out = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(src) if l.strip()]
messages = [[{"role": m["role"], "content": m["content"]} for m in r["messages"]] for r in rows]
ids = [f"sample-{i}" for i in range(len(rows))]
cats = ["chat"] * len(rows)
pq.write_table(pa.table({"id": ids, "messages": messages, "category": cats}), f"{out}/messages.parquet")
speaker = {"user": "human", "assistant": "gpt", "system": "system"}
sharegpt = [[{"from": speaker[m["role"]], "value": m["content"]} for m in ms] for ms in messages]
pq.write_table(pa.table({"conversations": sharegpt}), f"{out}/conversations.parquet")
pq.write_table(pa.table({"turns": messages}), f"{out}/wrong_column.parquet")
ints = [[{"role": m["role"], "content": len(m["content"])} for m in ms] for ms in messages]
pq.write_table(pa.table({"messages": ints}), f"{out}/wrong_types.parquet")
print(f"{len(rows)} rows")
