from neurons.miner.cli import main

raise SystemExit(main())
