"""The kubectl plugin for FSDPTrainingRuns (`kubectl trainingrun`), apart from the operator, which neither
imports nor ships it. Of the trainer it knows the contract only (fsdp_trainer.contract)."""
