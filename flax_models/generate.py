"""``python -m flax_models.generate DIR ...``: the text generation CLI
(``flax_models.serving.cli``)."""

import sys

from flax_models.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
