"""EPLB's weight moves (deepinfer_core/parallel/eplb_runtime.moved_weight, through the communicator's `exchange`)
in a real gloo world of 2 processes:
plain, BlockFP8 (FP8 values, float32 and E8M0 scales) and MXFP4 (packed FP4 codes, E8M0 scales) stacks of
expert weights end up on each rank as the new placement's slots of the full stack, byte for byte.

The world runs a script written to a temporary folder (spawned processes import their target from it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, socket, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
    from deepinfer_core.backend.weight_formats import BlockFP8, MXFP4
    from deepinfer_core.parallel.eplb import rebalance
    from deepinfer_core.parallel.communicator import AllToAllCommunicator
    from deepinfer_core.parallel.eplb_runtime import moved_weight
    from deepinfer_core.parallel.expert_slots import ExpertSlots

    E, WORLD = 6, 2

    def full_stacks():
        g = torch.Generator().manual_seed(0)
        plain = torch.randn(E, 8, 64, generator=g)
        fp8 = BlockFP8.quantize(torch.randn(E, 64, 64, generator=g), block=(32, 32))
        e8m0 = BlockFP8(fp8.weight, torch.randint(100, 140, fp8.scale.shape, generator=g, dtype=torch.uint8)
                        .view(torch.float8_e8m0fnu), (32, 32))
        fp4 = MXFP4(torch.randint(0, 256, (E, 8, 32), generator=g, dtype=torch.uint8),
                    torch.randint(100, 140, (E, 8, 2), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu))
        return {"plain": plain, "fp8": fp8, "e8m0": e8m0, "fp4": fp4}

    def rows(w, slots):
        index = torch.tensor(slots, dtype=torch.long)
        if isinstance(w, torch.Tensor):
            return w[index]
        return type(w)(**{**{f: getattr(w, f) for f in w.__dataclass_fields__}, "weight": w.weight[index],
                          "scale": w.scale[index]})

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                      b.view(torch.uint8) if b.element_size() == 1 else b)
        return type(a) is type(b) and same(a.weight, b.weight) and same(a.scale, b.scale)

    def main(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        old = ExpertSlots.default(E, WORLD)                      # experts 0-2 on rank 0, 3-5 on rank 1
        loads = torch.tensor([[1.0, 1, 1, 9, 8, 1]])             # two hot experts on rank 1
        new = ExpertSlots.from_placement(rebalance(loads, 8, 1, 1, WORLD), 0)
        assert new.physical_to_logical != old.physical_to_logical
        for name, full in full_stacks().items():
            local = rows(full, old.held_by(rank, WORLD))
            got = moved_weight(old, new, local, AllToAllCommunicator())
            want = rows(full, new.held_by(rank, WORLD))
            assert same(got, want), (name, rank, new.physical_to_logical)
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(main, args=(port,), nprocs=WORLD)
        print("moved", flush=True)
""")


def test_plain_fp8_and_fp4_expert_stacks_move_to_their_new_slots(tmp_path):
    script = tmp_path / "moves.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "moved" in done.stdout, done.stdout + done.stderr
