"""`python -m turnrl.config [params.yaml] [-S key=value]`: what `turnrl config` runs."""
from turnrl.config.loading import main

raise SystemExit(main())
