import sys

from fblc.cli import main

sys.exit(main())
