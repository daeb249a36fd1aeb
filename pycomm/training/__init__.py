"""Synchronous training algorithms behind one registry (docs/algorithms.md §4).

    algo = pycomm.training.create("bmuf", model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  sync_period=8, nesterov=True)
    for x, y in data:
        algo.zero_grad(); loss_fn(model(x), y).backward(); algo.step()
    algo.finalize()

ssgd, backup_sgd (synchronous SGD with backup workers), model_averaging, bmuf (CBM/NBM, BMUF-Adam via moment_sync), easgd, admm; through the parameter
server (pycomm.ps, docs/algorithms.md §5): asgd, ssp, dcasgd (constant or adaptive lambda), adadelay; on one node without locks: hogwild; SSGD in groups, ASGD between them: hybrid.
"""
from .adadelay import AdaDelay, AdaDelayConfig
from .admm import ADMM, ADMMConfig
from .asgd import ASGD, ASGDConfig
from .backup_sgd import BackupSGD, BackupSGDConfig
from .base import Algorithm, JobConfigError
from .bmuf import BMUF, BMUFConfig, MOMENT_SYNC
from .dcasgd import DCASGD, DCASGDConfig
from .easgd import EASGD, EASGDConfig
from .hogwild import Hogwild, HogwildConfig
from .hybrid import Hybrid, HybridConfig
from .model_averaging import ModelAveraging, ModelAveragingConfig
from .registry import ALGORITHMS, config_fields, create, get, make_config, names, server_sgd
from .ssgd import SSGD, SSGDConfig
from .ssp import SSP, SSPConfig

__all__ = ["ASGD", "ASGDConfig", "BackupSGD", "BackupSGDConfig", "AdaDelay", "AdaDelayConfig", "DCASGD", "DCASGDConfig", "SSP", "SSPConfig", "Hogwild",
           "HogwildConfig", "Hybrid", "HybridConfig", "JobConfigError",
           "ADMM", "ADMMConfig", "ALGORITHMS", "Algorithm", "BMUF", "BMUFConfig", "EASGD", "EASGDConfig",
           "MOMENT_SYNC", "ModelAveraging", "ModelAveragingConfig", "SSGD", "SSGDConfig", "config_fields",
           "create", "get", "make_config", "names", "server_sgd"]
