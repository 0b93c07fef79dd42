"""``python -m paratrain.run -n 4 script.py``: the launcher without the console script."""
import sys

from .launch.local import main

if __name__ == "__main__":
    sys.exit(main())
