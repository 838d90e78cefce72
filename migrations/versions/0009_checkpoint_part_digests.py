"""checkpoint parts carry their sha256

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 22:00:00
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Parts recorded before this have no digest: a resume refuses them (never unpacked unverified).
    op.add_column(
        'checkpoints',
        sa.Column(
            'part_sha256',
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'),
            nullable=True,
        ),
    )


def downgrade() -> None:
    op.drop_column('checkpoints', 'part_sha256')
