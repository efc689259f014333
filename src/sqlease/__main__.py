import sys

from sqlease.cli import main

sys.exit(main())
