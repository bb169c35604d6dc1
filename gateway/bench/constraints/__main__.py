from gateway.bench.constraints.cli import main

raise SystemExit(main())
