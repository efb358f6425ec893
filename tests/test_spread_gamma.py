"""measure.spread with looks at two adjacent grid rates (make benchmark part 4 --spread-at 26.91,32): each server's
integral against adaptive quadrature split at its kinks (a look at the higher rate reaches the share's cap there), and
the knees' CV interval's coverage on planted studies of the GPU design (6 servers, one look at each rate)."""
import math

import numpy as np
import pytest
from scipy import integrate

from measure import spread

R1, R2 = 26.91, 32.0
# servers unlike each other: none over at the lower rate, most at the higher (near the cap), one look only, two a rate
TWO = [[(527, 0, R1), (490, 31, R2)], [(540, 3, R1), (467, 114, R2)], [(540, 60, R1), (480, 470, R2)],
       [(500, 500, R2)], [(520, 9, R1)], [(530, 1, R1), (530, 4, R1), (480, 40, R2), (470, 80, R2)]]


def brute(looks, log_mu: float, sigma: float, phi: float, gamma: float) -> float:
    """One server's log-likelihood by scipy's quad over its log share u at R1 ~ N(log_mu, sigma^2), split at the
    integrand's mode, at u = 0 and at each kink -gamma log(r / R1)."""
    m = (max(phi, 1.0) + 1) / 2

    def g(u):
        u = np.atleast_1d(u)
        return sum(spread.cluster_logpmf(o, n * np.exp(np.minimum(u + gamma * math.log(r / R1), 0.0)) / m, phi)
                   for n, o, r in looks) - (u - log_mu) ** 2 / (2 * sigma ** 2)
    lo, hi = log_mu - 40 * sigma - 40, log_mu + 40 * sigma
    grid = np.linspace(lo, hi, 20001)
    values = g(grid)
    top, mode = values.max(), grid[values.argmax()]
    edges = [lo] + sorted(p for p in {mode, 0.0, -gamma * math.log(R2 / R1)} if lo < p < hi) + [hi]
    total = sum(integrate.quad(lambda x: math.exp(g(x)[0] - top), a, b, epsabs=0, epsrel=1e-12, limit=500)[0]
                for a, b in zip(edges[:-1], edges[1:]))
    return top + math.log(total) - math.log(sigma) - 0.5 * math.log(2 * math.pi)


@pytest.mark.parametrize("gamma,sigma,phi,log_mu", [(13.0, 1.2, 6.9, -3.0), (5.0, 2.5, 1.0, -4.0),
                                                    (25.0, 0.05, 30.0, -1.0), (13.0, 0.3, 3.0, -4.5)])
def test_each_servers_integral_across_its_kink_agrees_with_adaptive_quadrature(gamma, sigma, phi, log_mu):
    got = spread._Looks(TWO).server_logliks(log_mu, sigma, phi, gamma)
    want = np.array([brute(s, log_mu, sigma, phi, gamma) for s in TWO])
    assert np.abs(got - want).max() < 1e-4, got - want  # measured <= 2.2e-5 over 27 cases like these
    # gamma moves nothing where every look is at one rate
    one = [[x for x in s if x[2] == R1] for s in TWO]
    one = [s for s in one if s]
    assert spread._Looks(one).loglik(log_mu, sigma, phi, gamma) == pytest.approx(
        spread._Looks(one).loglik(log_mu, sigma, phi, 0.0), abs=1e-9)


def planted(rng, cv: float, phi: float, gamma: float, servers: int = 6, share: float = 0.01):
    """Piece 3's design: each server's knee spread by `cv`, its share at R1 share x (knee's)^-gamma, one look of 540
    counted at 26.91 and one of 640 at 32 (20 s of counted arrivals each), counts a compound Poisson as in
    tests/test_rule_simulation.py."""
    m = (phi + 1) / 2
    out = []
    for _ in range(servers):
        z = rng.normal()
        out.append([(n, int(min(n, rng.geometric(1 / m, rng.poisson(n * min(share * math.exp(cv * gamma * z)
                                                                              * (r / R1) ** gamma, 1.0) / m)).sum())),
                     r) for r, n in ((R1, 540), (R2, 640))])
    return out


def test_the_knees_cv_interval_covers_a_planted_spread_about_nine_times_in_ten():
    """The profile-likelihood interval of sigma / gamma (gamma free) holds the planted CV where the likelihood ratio
    at it is under the chi-square bound (what fit's interval reads off its profile). 50 studies of 6 servers at the
    stored spread's accurate CV 9.4 %, gamma 13, dispersion 6.9; 100 such studies covered 89 (the interval runs a
    little short with 6 servers: sigma's maximum likelihood is biased low)."""
    rng = np.random.default_rng(50)
    cv, phi, gamma = 0.094, 6.9, 13.0
    truth = np.array([math.log(0.01), cv * gamma, math.log(phi), gamma])
    covered, gammas = 0, []
    for _ in range(50):
        looks = spread._Looks(planted(rng, cv, phi, gamma))
        ll, best = spread._fit(looks, start=truth)
        at = spread._fit(looks, cv=cv, start=best)[0]
        covered += 2 * (max(ll, at) - at) <= spread.LR_95
        gammas.append(best[3])
    print("covered", covered, "of 50; gamma's median", np.median(gammas))
    assert covered >= 42, covered  # 84 %: at 89 % (measured on 100) 42 or more in ~90 % of seeds; nominal 47.5
    assert 11 < np.median(gammas) < 15, gammas


def test_a_steep_wall_gets_an_interval_that_holds_its_estimate():
    """The cpu profile's stored looks (8 fresh servers at 9.8 and 10.3 req/s, a capacity wall): gamma fits ~66. A grid
    that ended at 64 reported [33.8, 64], the estimate outside its own interval; the profile's block is this fit."""
    import common
    sp = common.load_params().knee.server_spread.model_dump()
    rates = sp["rates"]
    got = spread.fit([[(n, over, rates[i]) for over, n, i in s] for s in sp["looks_per_server"]], sp["rate"])
    print(got)
    assert got.gamma_ci[0] <= got.gamma <= got.gamma_ci[1] and got.gamma_ci[1] > 64, got
    assert got.cv_ci[0] <= got.cv <= got.cv_ci[1], got
    assert (got.sigma, list(got.sigma_ci), got.gamma, list(got.gamma_ci), got.cv, list(got.cv_ci)) == (
        sp["sigma"], sp["sigma_ci"], sp["gamma"], sp["gamma_ci"], sp["knee_cv"], sp["knee_cv_ci"])
