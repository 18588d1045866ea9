"""vLLM's own KV event publisher (distributed/kv_events.ZmqEventPublisher) driven from stdin, for the
router's subscriber tests: run with the vLLM venv's python. Each line is one JSON batch of events:
``[["stored", hashes, parent, tokens, block_size, extra], ["removed", hashes], ["cleared"]]``; ``"quit"``
stops it. It prints "ready" once bound and "sent N" after each batch is handed to the publisher."""

import json
import sys
import time

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

endpoint, replay, buffer_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=buffer_steps, topic="kv")
print("ready", flush=True)
n = 0
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd == "quit":
        break
    events = []
    for e in cmd:
        if e[0] == "stored":
            extra = e[5] if len(e) > 5 else None
            events.append(BlockStored(block_hashes=e[1], parent_block_hash=e[2], token_ids=e[3], block_size=e[4],
                                      lora_id=None, medium="GPU", lora_name=None, extra_keys=extra))
        elif e[0] == "removed":
            events.append(BlockRemoved(block_hashes=e[1], medium="GPU"))
        else:
            events.append(AllBlocksCleared())
    pub.publish(KVEventBatch(ts=time.time(), events=events))
    n += 1
    time.sleep(0.05)  # the publisher's thread sends it
    print(f"sent {n}", flush=True)
pub.shutdown()
