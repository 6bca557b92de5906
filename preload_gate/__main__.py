import sys

from preload_gate.cli import main

sys.exit(main())
