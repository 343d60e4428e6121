import sys

from paratrain.docs_check.cli import main

sys.exit(main())
