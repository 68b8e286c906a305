"""Models on disk and on the Hub: downloads, discovery of local models, the catalogue.

    pull(repo, quant=, revision=, on_progress=, cancel=) -> LocalModel
    plan_pull(repo, quant=, revision=) -> PullPlan
    list_local_models() -> [LocalModel]
    catalogue.load() -> Catalogue; catalogue.rank_for(hardware) -> [Ranked]
"""

from hybridmoe.backend.hub.discover import list_local_models
from hybridmoe.backend.hub.download import PullPlan, plan_pull, pull
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.hub.meter import DownloadProgress

__all__ = ["DownloadProgress", "LocalModel", "PullPlan", "list_local_models", "plan_pull", "pull"]
