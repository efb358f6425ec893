"""What a measuring stage measures with: the knee's probe sizes, counts and search grid (probing), the eval's
answer scoring (score), and the traffic that bench and knee send (workload). The stages eval, bench and knee stand
on it, so it holds no judgement: how a number is compared, kept or reverted lives in judgement/.

May import: common.
"""
