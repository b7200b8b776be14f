"""Post-training: supervised fine-tuning (`sft`) and preference optimisation (`dpo`; ORPO and SimPO on its pairs,
`preference`; KTO on unpaired rows, `kto`), on the one train loop.

Each is data (prompt/completion rows, numpy only) plus, where plain
cross-entropy is not the objective, one `maxbridge.loss.Loss`; GRPO's data is
sampled from the policy as it trains (`grpo.Rollouts`).
"""
