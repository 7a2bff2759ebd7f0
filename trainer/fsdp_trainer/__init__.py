"""FSDP2 fine-tuning on Ray Train: the code the operator submits into the RayCluster.

`fsdp_trainer.contract` (pydantic only) is shared with the operator; nothing imported here may pull in torch,
Ray or transformers, so the operator can import the contract without them.
"""
