import sys

from spin_cluster.bench.harness import main

sys.exit(main())
