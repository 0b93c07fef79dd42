"""One worker of ``paratrain train``: ``python -m paratrain.train.worker [options]``.

The front-end (job.py) starts these through the launcher with the user's
options and ``--run-dir``. Errors a user can fix (a checkpoint from another
model, a batch larger than the data) end the worker with one clear line
instead of a traceback; the launcher then stops the others and shows it.
"""
import sys

from . import layout
from .options import build_parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    layout.resolve(args, argv)   # the front-end checked it
    from .trainer import run
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"paratrain train: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
