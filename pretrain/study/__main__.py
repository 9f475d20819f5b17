import sys

from pretrain.study.driver import main

sys.exit(main())
