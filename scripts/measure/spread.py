"""How far apart fresh servers of one config sit at one offered rate (`make benchmark` part 4 with --spread-at):
the share of a look's counted requests over the SLO, split into its spread between servers and within one.

The model is the one the rule's simulation draws from (tests/test_rule_simulation.py), fitted by maximum likelihood:
- server s sends a share mu x exp(sigma z_s) of its requests over the SLO, z_s ~ N(0, 1): `sigma` is the between-
  server SD of the log share. Where the share rises with the rate as (rate / knee)^gamma (the wall; gamma 13 on the
  H200 study), that is fresh servers' knees spread by a CV of sigma / gamma;
- a look of n counted requests on it counts over the SLO a compound Poisson of clusters of geometric size, mean
  (phi + 1) / 2 (the requests' dispersion `phi`, knee.dispersion: variance phi x n x share).
The likelihood of each server's looks is integrated over its effect on a grid of its own, centred at its mode and
scaled by its width there (_Looks.server_logliks): a fixed rule over z_s (40 Gauss-Hermite nodes, before) snapped
sigma to a node, as a server of a few hundred looked-at requests pins its log share far tighter than the nodes' spacing
(the gpu-shape-4090 study: knees' CV 12.9 %, 9.4 % integrated accurately). Each parameter's 95 % interval is its
profile likelihood's (the likelihood-ratio bound, chi-square 1 df). Pure functions: no engine, no files."""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize, special

POINTS = 81         # trapezoid points over a server's effect (_Looks.server_logliks: ~1e-9 of the log-likelihood)
GAUSS = 40          # Gauss-Legendre nodes a piece where looks at two rates cut its range at a kink (~1e-7)
TAIL = 40.0         # a server's integral is cut where its integrand is below e^-TAIL of its value at the mode
LR_95 = 3.841       # chi-square(1) 95 % point: the profile likelihood's interval
SIGMA_GRID = np.concatenate([np.linspace(0.0, 1.0, 11)[:-1], np.linspace(1.0, 4.0, 13)])
# the wall's exponent, where looks fit it: up to 256, as the fit may reach (a cpu wall read 65.6, and a grid ending at
# 64 gave it the interval [33.8, 64], its estimate outside)
GAMMA_GRID = np.exp(np.linspace(math.log(2.0), math.log(256.0), 15))
GAMMA_MAX = 300.0   # the fit's bound on gamma: past the grid's end
CV_GRID = np.concatenate([np.linspace(0.0, 0.1, 6)[:-1], np.linspace(0.1, 0.4, 7)])  # the knees' CV, likewise
# The wall's exponent where looks at one rate cannot measure it: the share over the SLO rose as (rate / knee)^13 in
# the H200 probe study (tests/test_rule_simulation.py; one look at 14 req/s against 8 at 11.31)
GAMMA = 13.0


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


@functools.cache
def _gauss(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.polynomial.legendre.leggauss(n)


def _look(x, rate: float | None) -> tuple[int, int, float]:
    """A look (counted, over) at `rate`, or (counted, over, its own rate)."""
    n, o, *r = x
    return int(n), int(o), float(r[0] if r else rate or 1.0)


class _Looks:
    """Servers' looks flattened once for a fit, so that one likelihood is a few array operations over every server.

    A look of k over the SLO has P[k | lam] = e^-lam sum_j c_kj lam^j (cluster_logpmf's sum over j clusters): its
    terms (look, j) are stored flat, each with log c_kj's part that does not depend on phi."""

    def __init__(self, servers: list[list[tuple]], rate: float | None = None):
        servers = [[_look(x, rate) for x in s] for s in servers if s]
        self.n = np.array([n for s in servers for n, _, _ in s], dtype=float)
        self.k = np.array([o for s in servers for _, o, _ in s], dtype=int)
        rates = np.array([r for s in servers for _, _, r in s], dtype=float)
        self.rate = float(rates.min())  # the reference rate: the server's effect is its log share there
        self.dlog = np.log(rates / self.rate)  # each look's rate over it, in logs: its log share is gamma x this more
        self.rates = sorted(set(rates.tolist()))
        self.server = np.array([i for i, s in enumerate(servers) for _ in s])
        self.by_server = (self.server[None, :] == np.arange(len(servers))[:, None]).astype(float)
        self.over = self.by_server @ self.k
        self.counted = self.by_server @ self.n
        # where a look above the reference rate reaches the share's cap: a kink in the server's integrand at log share
        # -gamma x dlog (servers x kinks, inf where the server has no look at that rate)
        up = sorted({d for d in self.dlog.tolist() if d > 0})
        self.kinks = np.array([[d if np.any((self.server == i) & np.isclose(self.dlog, d)) else np.inf for d in up]
                               for i in range(len(servers))]).reshape(len(servers), len(up))
        j = [np.arange(1, k + 1) if k else np.array([0]) for k in self.k]
        self.look = np.repeat(np.arange(len(self.k)), [len(x) for x in j])
        self.j = np.concatenate(j).astype(float)
        self.starts = np.flatnonzero(np.r_[True, self.look[1:] != self.look[:-1]])
        k = self.k[self.look].astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):  # k = 0 has the one term j = 0, c = 1
            comb = special.gammaln(k) - special.gammaln(self.j) - special.gammaln(k - self.j + 1)
        self.comb = np.where(k > 0, comb - special.gammaln(self.j + 1), 0.0)
        self.rest_k = k - self.j  # theta's power

    def _coef(self, phi: float) -> tuple[np.ndarray, float]:
        """log c_kj at this phi, and the clusters' mean size m."""
        m = (max(phi, 1.0) + 1) / 2
        if m <= 1 + 1e-12:  # Poisson: the one term j = k
            return np.where(self.rest_k == 0, self.comb, -np.inf), 1.0
        theta = 1 - 1 / m
        return self.comb + self.j * math.log(1 - theta) + self.rest_k * math.log(theta), m

    def _terms(self, coef, m, u: np.ndarray, slopes: bool = False, gamma: float = 0.0):
        """Each server's log-likelihood at log shares u (servers x points) at the reference rate (a look at a rate r
        above it: u + gamma log(r / reference)); with `slopes`, its first and second derivatives in u too (from the
        number of clusters' conditional mean and variance given k: d/dlog lam of log sum_j c_kj lam^j is E[j], of
        E[j] Var[j]). A share is at most 1: above it the likelihood is flat."""
        at = u[self.server] + (gamma * self.dlog)[:, None]
        loglam = np.log(self.n / m)[:, None] + np.minimum(at, 0.0)
        a = coef[:, None] + self.j[:, None] * loglam[self.look]
        top = np.maximum.reduceat(a, self.starts, axis=0)
        e = np.exp(a - top[self.look])
        s0 = np.add.reduceat(e, self.starts, axis=0)
        lam = np.exp(loglam)
        ll = self.by_server @ (top + np.log(s0) - lam)
        if not slopes:
            return ll
        ej = e * self.j[:, None]
        mean = np.add.reduceat(ej, self.starts, axis=0) / s0
        var = np.add.reduceat(ej * self.j[:, None], self.starts, axis=0) / s0 - mean ** 2
        below = at < 0
        return ll, self.by_server @ ((mean - lam) * below), self.by_server @ ((var - lam) * below)

    def _integrand(self, coef, m, log_mu: float, sigma: float, s: np.ndarray, slopes: bool = False,
                   gamma: float = 0.0):
        """log of likelihood x prior density x du/ds at logit shares s (servers x points), less the prior's
        normalising constant; with `slopes`, its first and second derivatives in s too."""
        u = -np.logaddexp(0.0, -s)  # log share
        p = np.exp(u)
        prec = 1 / sigma ** 2
        terms = self._terms(coef, m, u, slopes, gamma)
        ll, d1, d2 = terms if slopes else (terms, None, None)
        g = ll - (u - log_mu) ** 2 * prec / 2 - np.logaddexp(0.0, s)  # du/ds = 1 - share
        if not slopes:
            return g
        gu, guu = d1 - (u - log_mu) * prec, d2 - prec  # in u, then through u(s): u' = 1 - p, u'' = -p (1 - p)
        return g, gu * (1 - p) - p, guu * (1 - p) ** 2 - (gu + 1) * p * (1 - p)

    def _modes(self, coef, m, log_mu: float, sigma: float,
               gamma: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each server's mode in s of _integrand (safeguarded Newton: the compound Poisson's log-likelihood is not
        concave in log lam everywhere), the integrand there, and its SD there."""
        data = (self.over + 0.5) / m  # the server's own evidence, in clusters: start between it and the prior
        w = data / (data + 1 / sigma ** 2)
        counted = self.by_server @ (self.n * np.exp(gamma * self.dlog))  # its looks' counts at the reference rate
        u = np.minimum(w * np.log((self.over + 0.5) / counted) + (1 - w) * log_mu, -1e-3)
        s = (u - np.log(-np.expm1(u)))[:, None]
        g, g1, g2 = self._integrand(coef, m, log_mu, sigma, s, slopes=True, gamma=gamma)
        for _ in range(60):
            step = np.clip(np.where(g2 < 0, g1 / np.abs(np.where(g2 < 0, g2, 1.0)), np.sign(g1)), -2.0, 2.0)
            for _ in range(30):  # halve a step that lowers the integrand
                gn, g1n, g2n = self._integrand(coef, m, log_mu, sigma, s + step, slopes=True, gamma=gamma)
                worse = gn < g - 1e-12 * (1 + np.abs(g))
                if not worse.any():
                    break
                step = np.where(worse, step / 2, step)
            s, g, g1, g2 = s + step, gn, g1n, g2n
            if np.all(np.abs(step) < 1e-10 * (1 + sigma)):
                break
        return s[:, 0], g[:, 0], np.where(g2 < 0, 1 / np.sqrt(np.abs(g2)), sigma)[:, 0]

    def server_logliks(self, log_mu: float, sigma: float, phi: float, gamma: float = 0.0) -> np.ndarray:
        """Each server's log-likelihood, its effect integrated out: the integral over the logit of its share at the
        reference rate, s (u = log share = -softplus(-s), so that the share's cap at 1 is not a kink inside the
        range), on s = s0 + a sinh(t): centred at the server's mode s0, scaled by its SD a there, and reaching where
        the integrand is below e^-TAIL of the mode's on each side in a few points, however much wider than a the
        prior is (a server with none over the SLO: the prior's width on one side). Looks at one rate: the trapezoid
        rule, t evenly spaced (spectrally accurate: the integrand is smooth and decays at both ends). Looks at a
        higher rate too: each reaches its cap at u = -gamma log(r / reference), a kink in the integrand, so the
        range in t is cut there and each piece integrated by Gauss-Legendre (the trapezoid rule across a kink is
        only second-order). The share at its cap (u > 0: every look capped) adds its likelihood there x P[u > 0]."""
        coef, m = self._coef(phi)
        if sigma <= 0:
            return self._terms(coef, m, np.full((len(self.over), 1), min(log_mu, 0.0)), gamma=gamma)[:, 0]
        s0, g0, a = self._modes(coef, m, log_mu, sigma, gamma)

        def logit(u):  # of the share e^u, u < 0
            u = np.minimum(u, -1e-300)
            return u - np.log(-np.expm1(u))
        # the integrand is below e^(g0 - TAIL) where the prior alone is (likelihood <= 1, du/ds < 1), and where
        # du/ds = 1 - share < e^-s is
        reach = sigma * np.sqrt(2 * np.maximum(TAIL - g0, TAIL))
        lo = logit(log_mu - reach)
        hi = np.minimum(np.where(log_mu + reach < 0, logit(log_mu + reach), np.inf), TAIL - np.minimum(g0, 0.0))
        t_lo, t_hi = np.arcsinh(np.maximum(s0 - lo, 0.0) / a), np.arcsinh(np.maximum(hi - s0, 0.0) / a)
        if gamma > 0 and self.kinks.size:
            with np.errstate(over="ignore", invalid="ignore"):
                s_k = logit(-gamma * self.kinks)  # inf where the server has no look at that rate: past t_hi
                t_k = np.where(np.isfinite(self.kinks), np.arcsinh((s_k - s0[:, None]) / a[:, None]), np.inf)
            edges = np.sort(np.clip(np.column_stack([-t_lo, t_k, t_hi]), -t_lo[:, None], t_hi[:, None]), axis=1)
            x, w = _gauss(GAUSS)
            half, mid = np.diff(edges, axis=1) / 2, (edges[:, 1:] + edges[:, :-1]) / 2  # servers x pieces
            t = (mid[:, :, None] + half[:, :, None] * x).reshape(len(s0), -1)
            logw = (np.log(np.maximum(half, 1e-300))[:, :, None] + np.log(w)).reshape(len(s0), -1)
        else:
            t = -t_lo[:, None] + (t_lo + t_hi)[:, None] * np.linspace(0.0, 1.0, POINTS)[None, :]
            logw = np.log((t_lo + t_hi) / (POINTS - 1))[:, None]
        g = self._integrand(coef, m, log_mu, sigma, s0[:, None] + a[:, None] * np.sinh(t), gamma=gamma)
        below_cap = (np.log(a) + special.logsumexp(g + logw + np.log(np.cosh(t)), axis=1)
                     - math.log(sigma) - 0.5 * math.log(2 * math.pi))
        at_cap = (self._terms(coef, m, np.zeros((len(self.over), 1)), gamma=gamma)[:, 0]
                  + special.log_ndtr(log_mu / sigma))
        return np.logaddexp(below_cap, at_cap)

    def loglik(self, log_mu: float, sigma: float, phi: float, gamma: float = 0.0) -> float:
        return float(self.server_logliks(log_mu, abs(sigma), phi, gamma).sum())


def loglik(servers: list[list[tuple]], log_mu: float, sigma: float, phi: float, gamma: float = 0.0,
           rate: float | None = None) -> float:
    """The looks' log-likelihood: the sum over servers of each one's, its effect integrated out (looks as fit takes
    them; log_mu the log share at the lowest rate)."""
    return _Looks(servers, rate).loglik(log_mu, sigma, phi, gamma)


def _start_gamma(looks: _Looks) -> float:
    """A first guess at the wall's exponent: the pooled shares at the lowest and the highest rate, capped at 1."""
    lo, hi = looks.dlog == 0, looks.dlog == looks.dlog.max()
    p_lo, p_hi = ((looks.k[x].sum() + 0.5) / looks.n[x].sum() for x in (lo, hi))
    return float(np.clip(math.log(min(p_hi, 1.0) / min(p_lo, 1.0)) / max(looks.dlog.max(), 1e-9), 1.0, 60.0))


def _fit(looks: _Looks, sigma: float | None = None, phi: float | None = None, gamma: float | None = None,
         cv: float | None = None, start=None) -> tuple[float, np.ndarray]:
    """Maximize over the free ones of (log mu, sigma, log phi, gamma); `cv` ties sigma to gamma (sigma = cv x
    gamma: the knees' CV held). Looks at one rate say nothing of gamma: it stays at its start's (GAMMA). Returns
    (log-likelihood, [log mu, sigma, log phi, gamma])."""
    mu0 = math.log(max(looks.over.sum(), 0.5) / looks.counted.sum())
    multi = len(looks.rates) > 1
    x0 = np.array(start if start is not None else [mu0, 0.3, math.log(3.0), _start_gamma(looks) if multi else GAMMA],
                  dtype=float)
    if len(x0) == 3:
        x0 = np.r_[x0, GAMMA]
    held = {1: sigma, 2: None if phi is None else math.log(phi), 3: gamma if multi else x0[3]}
    free = [i for i in range(4) if held.get(i) is None and not (i == 1 and cv is not None)]

    def full(x):
        v = np.array(x0, dtype=float)
        v[free] = x
        for i, value in held.items():
            if value is not None:
                v[i] = value
        if cv is not None:
            v[1] = cv * v[3]
        return v

    def nll(x):
        v = full(x)
        if (not -20 < v[0] < 0.5 or not -0.01 < v[1] < 6 or not -0.01 < v[2] < 5  # phi in [1, e^5]
                or not 0.5 < v[3] < GAMMA_MAX):
            return 1e12
        return -looks.loglik(v[0], abs(v[1]), max(math.exp(v[2]), 1.0), v[3] if multi else 0.0)
    res = optimize.minimize(nll, x0[free], method="Nelder-Mead",
                            options={"xatol": 1e-4, "fatol": 1e-5, "maxiter": 4000})
    return -float(res.fun), full(res.x)


@dataclass(frozen=True)
class SpreadFit:
    """The fit: `sigma` the between-server SD of the log share over the SLO (its 95 % interval), `phi` the
    within-look dispersion (its interval), the pooled share at the lowest rate, and what it rests on; `gamma` the
    wall's exponent, fitted with its interval where looks at two or more rates were given (`rates`), else fixed
    (gamma_ci None); `cv` the knees' CV sigma / gamma with its interval (profiled over gamma where gamma was fitted:
    its uncertainty is in the interval). A fit, not the params block: `make benchmark` part 4 writes knee.server_spread
    (config.ServerSpread) from it, with its looks and provenance (benchmark_noise.spread_block)."""
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
    rates: tuple[float, ...] = ()
    gamma: float = 0.0
    gamma_ci: tuple[float, float] | None = None
    cv: float = 0.0
    cv_ci: tuple[float, float] = (0.0, 0.0)

    def knee_cv(self, gamma: float | None = None) -> tuple[float, float, float]:
        """Fresh servers' knees' CV and its interval: the fit's own (gamma None), or sigma's over a wall of exponent
        `gamma` given (the share rises as (rate / knee)^gamma)."""
        if gamma is None:
            return self.cv, self.cv_ci[0], self.cv_ci[1]
        return self.sigma / gamma, self.sigma_ci[0] / gamma, self.sigma_ci[1] / gamma

    def as_dict(self) -> dict:
        return asdict(self)


def _best(looks: _Looks) -> tuple[float, np.ndarray]:
    """The maximum likelihood over (log mu, sigma, log phi, gamma), from four starts (sigma 0.1 or 1, phi 1.5 or 6;
    gamma the pooled shares' where looks at two rates fit it)."""
    v0 = _fit(looks, sigma=0.0, phi=1.0)[1]
    return max((_fit(looks, start=np.array([v0[0], sig, math.log(ph), v0[3]])) for sig in (0.1, 1.0)
                for ph in (1.5, 6.0)), key=lambda t: t[0])


def _looks_of(servers: list[list[tuple]], rate: float) -> _Looks:
    """fit's looks, refused (ValueError) where they cannot tell a spread."""
    if len(servers) < 2 or sum(len(s) for s in servers) < 3:
        raise ValueError(f"a spread needs >= 2 servers and >= 3 looks, got {len(servers)} servers")
    looks = _Looks(servers, rate)
    if not np.any((looks.k > 0) & (looks.k < looks.n)):
        # every look read 0 % or 100 % over the SLO: the likelihood is flat in sigma and gamma, and the optimiser
        # returns whatever it stopped at (a cpu run at 8 and 9.514 req/s, 0 of ~150 in all 16 looks, "fitted"
        # gamma 0.75 outside its own interval [2, 64]): no block is better than a made-up one
        at = ", ".join(f"{r:g}" for r in looks.rates)
        raise ValueError(f"no look at {at} req/s had some but not all of its counted requests over the SLO "
                         f"({int(looks.k.sum())} of {int(looks.n.sum())} over in {len(looks.n)} looks): the share, "
                         "and so the servers' spread, cannot be told at these rates; look where a few break it")
    return looks


def _profiled(looks: _Looks, grids: dict) -> tuple[float, np.ndarray, dict]:
    """The maximum likelihood and its parameters, and each parameter's profile likelihood on its grid. The
    profile's maximum can beat the free fit's (Nelder-Mead from one start): refit from the better until none does,
    so the estimates are the maximum the intervals are measured from."""
    best_ll, best = _best(looks)
    for _ in range(4):
        fits = {name: [_fit(looks, **{name: float(v)}, start=best) for v in grid] for name, grid in grids.items()}
        top_ll, top = max((f for fs in fits.values() for f in fs), key=lambda f: f[0])
        if top_ll <= best_ll + 1e-6:
            break
        best_ll, best = max([_fit(looks, start=top), (top_ll, top)], key=lambda f: f[0])
    on_grid = {name: [f[0] for f in fs] for name, fs in fits.items()}
    return max([best_ll] + [ll for lls in on_grid.values() for ll in lls]), best, on_grid


def _interval(looks: _Looks, name: str, grid: np.ndarray, on_grid: list[float], best_ll: float,
              best: np.ndarray) -> tuple[float, float]:
    """Where the profile of `name` crosses the likelihood-ratio bound: bracketed on the grid, then solved for
    (brentq)."""
    def prof(v):
        return _fit(looks, **{name: float(v)}, start=best)[0]

    d = np.array([2 * (best_ll - ll) - LR_95 for ll in on_grid])
    inside = np.flatnonzero(d <= 0)
    if not inside.size:
        return math.nan, math.nan

    def cross(a, b):
        return optimize.brentq(lambda v: 2 * (best_ll - prof(v)) - LR_95, grid[a], grid[b], xtol=1e-4)
    lo, hi = inside[0], inside[-1]
    return (cross(lo - 1, lo) if lo > 0 else float(grid[0])), \
        (cross(hi, hi + 1) if hi < len(grid) - 1 else float(grid[-1]))


# where the optimiser may take each parameter (_fit's nll): an estimate past its grid's end is there
_BOUNDS = {"sigma": (0.0, 6.0), "phi": (1.0, math.exp(5.0)), "gamma": (0.5, GAMMA_MAX), "cv": (0.0, 6.0 / 0.5)}


def _held(name: str, est: float, ci: tuple[float, float], grid: np.ndarray) -> tuple[float, float]:
    """The interval, holding its estimate: where the estimate lies past its grid's end and the profile never
    crossed the bound on that side, that end is the optimiser's bound there (the interval is open that far).
    One that still does not hold it is a fit that went wrong: refused, not widened to fit. No interval (the
    profile never within the bound on the grid) is left as it is."""
    lo_b, hi_b = _BOUNDS[name]
    lo, hi = ci
    if math.isnan(lo) or math.isnan(hi):
        return ci
    if est < grid[0] and lo <= grid[0]:
        lo = lo_b
    if est > grid[-1] and hi >= grid[-1]:
        hi = hi_b
    if not lo - 1e-6 <= est <= hi + 1e-6:
        raise ValueError(f"the fit's {name} {est:.4g} lies outside its own interval [{lo:.4g}, {hi:.4g}]: no "
                         "block is better than a wrong one")
    return lo, hi


def fit(servers: list[list[tuple]], rate: float, gamma: float | None = None) -> SpreadFit:
    """The model above fitted to looks on fresh servers: servers = [[look, ...], ...], each look (counted, over) at
    `rate` or (counted, over, its rate). At two or more rates the wall's exponent gamma is fitted with sigma and
    phi (sigma then is the log share's between-server SD at every rate, the knees' CV sigma / gamma); at one it is
    fixed at `gamma` (default GAMMA) and said so (gamma_ci None)."""
    servers = [list(s) for s in servers if s]
    looks = _looks_of(servers, rate)
    multi = len(looks.rates) > 1
    grids = {"sigma": SIGMA_GRID, "phi": np.exp(np.linspace(0.0, 4.5, 19))}
    if multi:
        grids.update(gamma=GAMMA_GRID, cv=CV_GRID)
    best_ll, best, on_grid = _profiled(looks, grids)

    def held(name, est):
        ci = _interval(looks, name, grids[name], on_grid[name], best_ll, best)
        return _held(name, est, ci, grids[name])
    at_ref = looks.dlog == 0
    counted = int(looks.n.sum())
    over = int(looks.k.sum())
    sigma = round(abs(float(best[1])), 3)
    sigma_ci = tuple(round(v, 3) for v in held("sigma", abs(float(best[1]))))
    if multi:
        g = round(float(best[3]), 2)
        g_ci = tuple(round(v, 2) for v in held("gamma", float(best[3])))
        cv = round(abs(float(best[1])) / float(best[3]), 4)
        cv_ci = tuple(round(v, 4) for v in held("cv", abs(float(best[1])) / float(best[3])))
    else:
        g, g_ci = GAMMA if gamma is None else float(gamma), None
        cv, cv_ci = round(sigma / g, 4), tuple(round(v / g, 4) for v in sigma_ci)
    return SpreadFit(rate=looks.rate, servers=len(servers), looks=len(looks.n), counted=counted,
                     over_slo=over, share=round(float(looks.k[at_ref].sum() / looks.n[at_ref].sum()), 5),
                     sigma=sigma, sigma_ci=sigma_ci,
                     phi=round(max(math.exp(float(best[2])), 1.0), 2),
                     phi_ci=tuple(round(v, 2) for v in held("phi", max(math.exp(float(best[2])), 1.0))),
                     between_df=len(servers) - 1, within_df=sum(len(s) - 1 for s in servers),
                     rates=tuple(looks.rates), gamma=g, gamma_ci=g_ci, cv=cv, cv_ci=cv_ci)


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
