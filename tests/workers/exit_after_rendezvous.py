"""Worker: rank 1 comes to the rendezvous, then exits before the next step of
pt.init() (argv[1]: "agree", the backend check; "engine", the engine's set-up).

The step is replaced on rank 1 by an exit, as if the process had crashed there;
the other ranks must fail with a RendezvousError naming rank 1, not torch's raw
store timeout. Prints the error's class and message on the other ranks.
"""
import os
import sys

import paratrain as pt
from paratrain.comm import rendezvous

world = sys.modules["paratrain.comm.world"]   # (paratrain.comm.world the name is the function)


def exit_now(*args, **kwargs):
    os._exit(0)


def main():
    if int(os.environ["RANK"]) == 1:
        if sys.argv[1] == "agree":
            rendezvous.agree = exit_now
        else:
            world._make_group = exit_now
    try:
        pt.init()
    except pt.CommError as e:
        print(f"init failed: {type(e).__name__}: {e}", flush=True)
        return 1
    print("init went through without rank 1", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
