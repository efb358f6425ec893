"""How far apart fresh servers of one config sit at one offered rate (`make benchmark` part 4 with --spread-at):
the share of a look's counted requests over the SLO, split into its spread between servers and within one.

The model is the one the rule's simulation draws from (tests/test_rule_simulation.py), fitted by maximum likelihood:
- server s sends a share mu x exp(sigma z_s) of its requests over the SLO, z_s ~ N(0, 1): `sigma` is the between-
  server SD of the log share. Where the share rises with the rate as (rate / knee)^gamma (the wall; gamma 13 on the
  H200 study), that is fresh servers' knees spread by a CV of sigma / gamma;
- a look of n counted requests on it counts over the SLO a compound Poisson of clusters of geometric size, mean
  (phi + 1) / 2 (the requests' dispersion `phi`, knee.dispersion: variance phi x n x share).
The likelihood of each server's looks is integrated over z_s (Gauss-Hermite); each parameter's 95 % interval is its
profile likelihood's (the likelihood-ratio bound, chi-square 1 df). Pure functions: no engine, no files."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize, special

NODES = 40          # Gauss-Hermite nodes over a server's effect
LR_95 = 3.841       # chi-square(1) 95 % point: the profile likelihood's interval
SIGMA_GRID = np.concatenate([np.linspace(0.0, 1.0, 11)[:-1], np.linspace(1.0, 4.0, 13)])


def cluster_logpmf(k: int, lam: np.ndarray, phi: float) -> np.ndarray:
    """log P[X = k] for X a Poisson(lam) number of clusters of geometric size, mean m = (phi + 1) / 2 (Polya-Aeppli;
    phi 1: plain Poisson), for each lam: the sum over j clusters of Poisson(j; lam) x P[j sizes add up to k], in logs
    (a look near the wall has lam ~ 100)."""
    lam = np.atleast_1d(np.asarray(lam, dtype=float))
    loglam = np.log(np.maximum(lam, 1e-300))
    m = (max(phi, 1.0) + 1) / 2
    if m <= 1 + 1e-12 or k == 0:
        return k * loglam - lam - math.lgamma(k + 1)
    theta = 1 - 1 / m  # P[size = i] = (1-theta) theta^(i-1); j sizes add up to k: C(k-1, j-1) (1-theta)^j theta^(k-j)
    j = np.arange(1, k + 1)
    comb = special.gammaln(k) - special.gammaln(j) - special.gammaln(k - j + 1)
    rest = comb - special.gammaln(j + 1) + j * math.log(1 - theta) + (k - j) * math.log(theta)
    return special.logsumexp(rest[:, None] + j[:, None] * loglam[None, :], axis=0) - lam


def _server_loglik(looks: list[tuple[int, int]], log_mu: float, sigma: float, phi: float,
                   nodes: np.ndarray, weights: np.ndarray) -> float:
    """log of one server's looks' likelihood, its effect integrated out: looks = [(counted, over), ...]."""
    share = np.minimum(np.exp(log_mu + sigma * nodes), 1.0)
    m = (max(phi, 1.0) + 1) / 2
    total = np.log(weights)
    for n, over in looks:
        total = total + cluster_logpmf(over, n * share / m, phi)
    return float(special.logsumexp(total))


def loglik(servers: list[list[tuple[int, int]]], log_mu: float, sigma: float, phi: float) -> float:
    x, w = np.polynomial.hermite_e.hermegauss(NODES)  # probabilists': weight exp(-z^2 / 2)
    w = w / w.sum()
    return sum(_server_loglik(s, log_mu, abs(sigma), phi, x, w) for s in servers if s)


def _fit(servers, sigma: float | None = None, phi: float | None = None, start=None) -> tuple[float, np.ndarray]:
    """Maximize over the free ones of (log mu, sigma, log phi); returns (log-likelihood, [log mu, sigma, log phi])."""
    over = sum(o for s in servers for _, o in s)
    counted = sum(n for s in servers for n, _ in s)
    mu0 = math.log(max(over, 0.5) / counted)
    x0 = start if start is not None else np.array([mu0, 0.3, math.log(3.0)])
    free = [i for i, v in enumerate((None, sigma, None if phi is None else math.log(phi))) if v is None]

    def full(x):
        v = np.array(x0, dtype=float)
        v[free] = x
        if sigma is not None:
            v[1] = sigma
        if phi is not None:
            v[2] = math.log(phi)
        return v

    def nll(x):
        v = full(x)
        if not -20 < v[0] < 0.5 or not -0.01 < v[1] < 6 or not -0.01 < v[2] < 5:  # phi in [1, e^5]
            return 1e12
        return -loglik(servers, v[0], abs(v[1]), max(math.exp(v[2]), 1.0))
    res = optimize.minimize(nll, x0[free], method="Nelder-Mead",
                            options={"xatol": 1e-4, "fatol": 1e-5, "maxiter": 4000})
    return -float(res.fun), full(res.x)


@dataclass(frozen=True)
class ServerSpread:
    """The fit: `sigma` the between-server SD of the log share over the SLO (its 95 % interval), `phi` the
    within-look dispersion (its interval), the pooled share, and what it rests on."""
    rate: float
    servers: int
    looks: int
    counted: int
    over_slo: int
    share: float
    sigma: float
    sigma_ci: tuple[float, float]
    phi: float
    phi_ci: tuple[float, float]
    between_df: int
    within_df: int

    def knee_cv(self, gamma: float) -> tuple[float, float, float]:
        """Fresh servers' knees' CV (and its interval) where the share rises as (rate / knee)^gamma."""
        return self.sigma / gamma, self.sigma_ci[0] / gamma, self.sigma_ci[1] / gamma

    def as_dict(self) -> dict:
        return asdict(self)


def fit(servers: list[list[tuple[int, int]]], rate: float) -> ServerSpread:
    """The model above fitted to looks at one `rate` on fresh servers: servers = [[(counted, over), ...], ...]."""
    servers = [list(s) for s in servers if s]
    if len(servers) < 2 or sum(len(s) for s in servers) < 3:
        raise ValueError(f"a spread needs >= 2 servers and >= 3 looks, got {len(servers)} servers")
    best_ll, best = max((_fit(servers, start=np.array([s0[0], sig, math.log(ph)]))
                         for s0 in [_fit(servers, sigma=0.0, phi=1.0)[1]]
                         for sig in (0.1, 1.0) for ph in (1.5, 6.0)), key=lambda t: t[0])
    prof_sigma = [(s, _fit(servers, sigma=float(s), start=best)[0]) for s in SIGMA_GRID]
    phis = np.exp(np.linspace(0.0, 4.5, 19))
    prof_phi = [(p, _fit(servers, phi=float(p), start=best)[0]) for p in phis]
    # the profile's maximum can beat the free fit's (Nelder-Mead from one start): take the better
    best_ll = max([best_ll] + [ll for _, ll in prof_sigma] + [ll for _, ll in prof_phi])

    def interval(profile):
        """Where the profile crosses the likelihood-ratio bound, read linearly between grid points."""
        v = np.array([x for x, _ in profile])
        d = np.array([2 * (best_ll - ll) - LR_95 for _, ll in profile])
        inside = np.flatnonzero(d <= 0)
        if not inside.size:
            return math.nan, math.nan
        lo, hi = inside[0], inside[-1]

        def cross(a, b):
            return float(v[a] + (v[b] - v[a]) * d[a] / (d[a] - d[b]))
        return (cross(lo - 1, lo) if lo > 0 else float(v[0])), (cross(hi, hi + 1) if hi < len(v) - 1 else float(v[-1]))
    counted = sum(n for s in servers for n, _ in s)
    over = sum(o for s in servers for _, o in s)
    return ServerSpread(rate=rate, servers=len(servers), looks=sum(len(s) for s in servers), counted=counted,
                        over_slo=over, share=round(over / counted, 5), sigma=round(abs(float(best[1])), 3),
                        sigma_ci=tuple(round(v, 3) for v in interval(prof_sigma)),
                        phi=round(max(math.exp(float(best[2])), 1.0), 2),
                        phi_ci=tuple(round(v, 2) for v in interval(prof_phi)),
                        between_df=len(servers) - 1, within_df=sum(len(s) - 1 for s in servers))


def moments(servers: list[list[tuple[int, int]]]) -> dict:
    """A cross-check by moments (no model of the server effect): the dispersion of looks about their server's share
    (within, Pearson chi-square over its df) and of servers' totals about the pooled share (between, over S - 1). With
    no server effect both read about phi."""
    servers = [s for s in servers if s]
    counted = sum(n for s in servers for n, _ in s)
    p = sum(o for s in servers for _, o in s) / counted
    xw = dw = 0.0
    for s in servers:
        n_s, o_s = sum(n for n, _ in s), sum(o for _, o in s)
        ps = o_s / n_s
        if 0 < ps < 1 and len(s) > 1:
            xw += sum((o - n * ps) ** 2 / (n * ps * (1 - ps)) for n, o in s)
            dw += len(s) - 1
    xb = sum((sum(o for _, o in s) - sum(n for n, _ in s) * p) ** 2 / (sum(n for n, _ in s) * p * (1 - p))
             for s in servers) if 0 < p < 1 else 0.0
    db = len(servers) - 1
    return {"within": round(xw / dw, 2) if dw else None, "within_df": int(dw),
            "between": round(xb / db, 2) if db else None, "between_df": db}
