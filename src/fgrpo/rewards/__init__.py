"""Rewards: uint8 images [B, H, W, 3] + prompts -> scores [B]. Start from `build_reward(spec)`."""

from fgrpo.rewards.base import Reward, RewardOutput
from fgrpo.rewards.client import HttpReward
from fgrpo.rewards.factory import build_reward
from fgrpo.rewards.jpeg import JpegReward, jpeg_compressibility, jpeg_incompressibility
from fgrpo.rewards.multi import Member, MultiReward
from fgrpo.rewards.ocr import OcrReward, RapidOcrEngine, extract_target, ocr_score
from fgrpo.rewards.runner import AsyncRewardRunner
from fgrpo.rewards.transport import RewardServiceError

__all__ = [
    "AsyncRewardRunner",
    "HttpReward",
    "JpegReward",
    "Member",
    "MultiReward",
    "OcrReward",
    "RapidOcrEngine",
    "Reward",
    "RewardOutput",
    "RewardServiceError",
    "build_reward",
    "extract_target",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "ocr_score",
]
