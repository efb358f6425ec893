"""What a measuring stage measures with: the knee's probe sizes, counts and search grid (probing), the eval's
answer scoring (score), the traffic that bench and knee send (workload), and the machine and software they measure
on (host). The stages eval, bench and knee stand on it, so it holds no judgement: how a number is compared, kept or
reverted lives in judgement/.

May import: common.
"""
