"""The Gaussian derivatives of a full row whose t* is within 1e-7 of 1 (ε = 4.9e5), the new
covariance ill-conditioned against the old (whitened spectrum ~1e12), against ⟨u, J v⟩ from a
60-digit mpmath oracle of the forward (math.md §6; a central difference with h = 1e-22). The
derivatives formed s = 1 − t from the stored t (half an ulp of t: 5e-10 of s here) and the
precision ratio as 1 + tg (g ≈ −1): ⟨u, J v⟩ along the new factor was 3.4e-8 off and along the
old mean 4.7e-10; with s from η and a = s + tγ (as the forward): ~1e-13 (docs/gaussian.md)."""

import numpy as np
import pytest

import troll.gaussian as G

MEAN = np.array([0.42007626621875394, 1.3502865164637041, 0.998474897514769, 1.106353048900839])
CHOL = np.array([[82.50277409710479, 0.0, 0.0, 0.0], [-387.17798888287655, 22.770871558678472, 0.0, 0.0],
                 [360.7249575684776, -10.75647510074531, 0.1661635342159101, 0.0],
                 [843.7260767660312, -27.49311128211773, 0.4543428516065511, 0.003203419142685277]])
OLD_MEAN = np.array([0.42270715269595555, 1.349079764489681, 1.0038252763281375, 1.110621913739204])
OLD_CHOL = np.array([[1.0768209495990055, 0.0, 0.0, 0.0], [0.16875969552331702, 0.9331436655910813, 0.0, 0.0],
                     [0.22169913891072887, 0.032679430807071974, 1.090494272096454, 0.0],
                     [0.16741875922188829, 0.09197776476273944, 0.12639445887135078, 0.9366765644023155]])
EPS = 488197.48314900324  # KL at 1 − t* = 1e-7

# (direction, u's mean part, u's factor part, v, reference ⟨u, J v⟩, the difference's rounding floor)
CASES = [
    ("cov", [-1.8057567532013612, -0.5970993182916895, 0.6647093281024036, -1.7566054931385635],
     [[0.29691964994609604, 0.0, 0.0, 0.0], [0.719940915642022, -1.4356979700011256, 0.0, 0.0], [1.0145112960140155, -1.4051828803795259, -0.8897572740537061, 0.0], [0.5605730537518138, -0.6710041818601992, 0.5326772106649051, 0.5750412421824047]],
     [[-111.25418338788141, 0.0, 0.0, 0.0], [528.3013992956807, 21.491948727749477, 0.0, 0.0], [-489.14260122655844, -10.137545129694725, -0.08073664729357875, 0.0], [-1144.6370038599496, -25.912630540607733, -0.2287673969057808, -0.0028941183281275887]],
     2.130442547485564, 0.0011557163411907757),
    ("old_mean", [0.8876549975818968, -1.2582614157818082, -2.0750411890270133, 0.10131878110779545],
     [[0.04315018995169208, 0.0, 0.0, 0.0], [-1.664456335414633, -0.802994761950618, 0.0, 0.0], [-0.5634867572415136, 1.0734322887009966, -0.590394990432462, 0.0], [-1.1499700706134441, -1.144268491554707, 0.028938146512655843, 0.44714502238769466]],
     [-0.32151986006839123, 0.07072830283276955, -0.8452960247248058, -0.19426691284010683],
     0.003469551170386564, 0.0017958175268816348),
]


@pytest.mark.parametrize("direction, u_mean, u_chol, v, ref, floor", CASES, ids=[c[0] for c in CASES])
def test_derivatives_near_t_one_against_mpmath(direction, u_mean, u_chol, v, ref, floor):
    rows = [np.ascontiguousarray(x[None]) for x in (MEAN, CHOL, OLD_MEAN, OLD_CHOL)]
    out_mean, out_chol, stats = G.project_joint(*rows, EPS, threads=1)
    assert int(stats.status[0]) == G.PROJECTED
    assert 0.0 < float(stats.eta[0]) < 2e-7
    u_mean, u_chol, v = np.array(u_mean), np.tril(np.array(u_chol)), np.array(v)
    tm, tc = G.project_jvp(*rows, EPS, EPS, out_mean, out_chol, stats, full=True, split=False, threads=1,
                           **{"tangent_" + direction: v[None].copy()})
    jvp = float(np.sum(u_mean * np.asarray(tm)[0]) + np.sum(u_chol * np.tril(np.asarray(tc)[0])))
    grads = G.project_backward(*rows, EPS, EPS, out_mean, out_chol, stats, u_mean[None].copy(), u_chol[None].copy(),
                               full=True, split=False, old=True, threads=1)
    g = np.asarray(grads[{"mean": 0, "cov": 1, "old_mean": 2, "old_cov": 3}[direction]])[0]
    vjp = float(np.sum((g if direction.endswith("mean") else np.tril(g)) * v))
    scale = max(abs(ref), floor)
    assert abs(jvp - ref) <= 1e-10 * scale
    assert abs(vjp - ref) <= 1e-10 * scale
