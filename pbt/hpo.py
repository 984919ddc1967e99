"""``agilerl.hpo`` under this package's name: ``from pbt.hpo import TournamentSelection,
Mutations, HyperparameterConfig, RLParameter``, defined in :mod:`pbt.agilerl.hpo`."""

from pbt.agilerl.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection

__all__ = ["HyperparameterConfig", "Mutations", "RLParameter", "TournamentSelection"]
