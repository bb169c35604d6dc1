import sys

from gateway.llamacpp.calibrate import main

raise SystemExit(main(sys.argv[1:]))
