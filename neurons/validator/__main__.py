from neurons.validator.cli import main

raise SystemExit(main())
