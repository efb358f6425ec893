"""Stage `download`: make every model in download.fetch available locally and write results/models.json.

Weights live outside git and .dvc/cache (download.store, or the Hugging Face cache), so 15 GB are never
doubled; the manifest records path, source, revision and hashes, and downstream stages depend on it.
Sources: serving/model_store.py.
"""
from __future__ import annotations

from pathlib import Path

import common
import config
from records.models import ModelsManifest
from serving.model_store import ModelError, provide, store_path


def main(out: Path):
    common.stage_setup()
    params = common.read_params()  # this stage needs only its own section: validated on its own
    cfg = config.section(params, "download")
    store = store_path(cfg)
    done: dict = {}
    for name in cfg["fetch"]:
        provide(name, cfg["catalog"], store, done)
    ModelsManifest.model_validate({"store": str(store), "models": {n: done[n] for n in cfg["fetch"]}}).save_file(out)


if __name__ == "__main__":
    args = common.paths(__doc__.split("\n")[0], models="results/models.json")
    common.run_stage(main, (ModelError, common.ParamsError), args.models)
