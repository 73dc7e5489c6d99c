"""A small training loop on the simulated device whose reward function keeps 6 MiB a step in a module-level list
(tests/scripts/leaky_rewards.py): the training process's memory watch (oomguard/child/memwatch.py) must find the leak,
its rate, and where it is held. Prints the events it would send, one JSON object per line.

    python tests/scripts/leaky_loop.py [--steps 14] [--capacity-mib 512] [--host]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--capacity-mib", type=int, default=512)
    p.add_argument("--host", action="store_true", help="leak host memory instead (16 MiB a step)")
    a = p.parse_args()
    if a.host:
        os.environ["HOST_LEAK_MIB"] = "16"
    import leaky_rewards
    import torch

    from oomguard.child import simulate
    from oomguard.child.memwatch import MemWatch

    torch.manual_seed(0)
    dev = simulate.start(a.capacity_mib << 20)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    dev.adopt(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = MemWatch(check_every=1, host_limit=8 << 30)
    for step in range(1, a.steps + 1):
        watch.step_begin()
        x = torch.randn(64, 256)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        (leaky_rewards.host_leaky_reward if a.host else leaky_rewards.leaky_reward)(["a completion"] * 4)
        for ev in watch.step_end(step):
            print(json.dumps(ev.to_json()), flush=True)


if __name__ == "__main__":
    main()
