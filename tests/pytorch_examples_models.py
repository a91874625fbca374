"""Ports of the official pytorch/examples training scripts, tiny, on synthetic data shaped like
their datasets (no torchvision): word_language_model, dcgan, vae, time_sequence_prediction,
reinforcement_learning (REINFORCE, actor-critic), siamese_network, super_resolution and
mnist_forward_forward. The models and losses are written as those scripts write them."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical
from torch.utils.data import DataLoader, TensorDataset

# --- word_language_model (model.py) --------------------------------------------------------

NTOKEN, NINP, NHID, NLAYERS, BPTT = 40, 16, 16, 2, 6


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type="LSTM", ntoken=NTOKEN, ninp=NINP, nhid=NHID, nlayers=NLAYERS,
                 dropout=0.2, tie_weights=True):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=64):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x):
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


class TransformerModel(nn.Transformer):
    """Container module with an encoder, a recurrent or transformer module, and a decoder."""

    def __init__(self, ntoken=NTOKEN, ninp=NINP, nhead=2, nhid=NHID, nlayers=NLAYERS, dropout=0.2):
        super().__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid,
                         num_encoder_layers=nlayers)
        self.model_type = "Transformer"
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        self.init_weights()

    def _generate_square_subsequent_mask(self, sz):
        return torch.log(torch.tril(torch.ones(sz, sz)))  # (0 on and below the diagonal, -inf)

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.input_emb.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src, src_mask):
        src = self.input_emb(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.encoder(src, mask=src_mask)
        output = self.decoder(output)
        return F.log_softmax(output, dim=-1)


def make_rnn_lm() -> nn.Module:
    torch.manual_seed(0)
    return RNNModel()


def make_transformer_lm() -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():  # (nn.Transformer's note on batch_first, as in the example)
        warnings.filterwarnings("ignore", "enable_nested_tensor is True")
        return TransformerModel()


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def corpus(n=400, seed=0):
    """A token stream (data.Corpus's train ids) with a little structure to learn."""
    g = torch.Generator().manual_seed(seed)
    return (torch.arange(n) * 3 + torch.randint(0, 3, (n,), generator=g)) % NTOKEN


def get_batch(source, i):
    seq_len = min(BPTT, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


# --- dcgan ---------------------------------------------------------------------------------

NZ, NGF, NDF, NC = 8, 8, 8, 1


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


def make_netD() -> nn.Module:
    torch.manual_seed(1)
    net = Discriminator()
    net.apply(weights_init)
    return net


def make_netG() -> nn.Module:
    torch.manual_seed(2)
    net = Generator()
    net.apply(weights_init)
    return net


class BCE(nn.Module):
    """nn.BCELoss written out by hand (as ports of the example to other losses do)."""

    def forward(self, output, label):
        return -(label * torch.log(output) + (1 - label) * torch.log(1 - output)).mean()


def real_images(i, n=8):
    """MNIST-like 16x16 digits in [-1, 1] (transforms.Normalize((0.5,), (0.5,)))."""
    g = torch.Generator().manual_seed(100 + i)
    return torch.rand(n, NC, 16, 16, generator=g) * 2 - 1


# --- vae -----------------------------------------------------------------------------------

class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 40)
        self.fc21 = nn.Linear(40, 8)
        self.fc22 = nn.Linear(40, 8)
        self.fc3 = nn.Linear(8, 40)
        self.fc4 = nn.Linear(40, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def make_vae() -> nn.Module:
    torch.manual_seed(0)
    return VAE()


def vae_loss_function(recon_x, x, mu, logvar):
    """Reconstruction + KL divergence losses summed over all elements and batch."""
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction="sum")
    # see Appendix B from VAE paper: Kingma and Welling. Auto-Encoding Variational Bayes
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def mnist_loader(n=64, batch_size=16, seed=0, bad=None, num_workers=0):
    """MNIST-shaped images in [0, 1] (transforms.ToTensor()); ``bad=(index, value)`` writes
    ``value`` over one image (a record read in 0..255, never scaled)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    if bad is not None:
        x[bad[0]] = x[bad[0]] * bad[1]
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False,
                      num_workers=num_workers)


# --- time_sequence_prediction --------------------------------------------------------------

class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 24)
        self.lstm2 = nn.LSTMCell(24, 24)
        self.linear = nn.Linear(24, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 24, dtype=input.dtype)
        c_t = torch.zeros(input.size(0), 24, dtype=input.dtype)
        h_t2 = torch.zeros(input.size(0), 24, dtype=input.dtype)
        c_t2 = torch.zeros(input.size(0), 24, dtype=input.dtype)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):  # if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def make_sequence() -> nn.Module:
    torch.manual_seed(0)
    return Sequence()


def sine_waves(n=12, length=20, seed=2):
    """generate_sine_wave.py's traindata: shifted sine waves, one per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.arange(length).float() + torch.randint(-16, 16, (n, 1), generator=g).float()
    return torch.sin(x / 4.0)


# --- reinforcement_learning ----------------------------------------------------------------

EPS = float(torch.finfo(torch.float32).eps)


class Policy(nn.Module):
    """reinforce.py's policy over CartPole's 4 observations and 2 actions."""

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(32, 2)

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


def make_policy() -> nn.Module:
    torch.manual_seed(0)
    return Policy()


def reinforce_loss(log_probs, rewards, gamma=0.99):
    """reinforce.py's finish_episode: discounted returns, normalised, times -log pi."""
    R, returns = 0.0, []
    for r in rewards.tolist()[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + EPS)
    return (-log_probs * returns).sum()


class ActorCritic(nn.Module):
    """actor_critic.py's two-headed policy."""

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.action_head = nn.Linear(32, 2)
        self.value_head = nn.Linear(32, 1)

    def forward(self, x):
        x = F.relu(self.affine1(x))
        action_prob = F.softmax(self.action_head(x), dim=-1)
        state_values = self.value_head(x)
        return action_prob, state_values


def make_actor_critic() -> nn.Module:
    torch.manual_seed(0)
    return ActorCritic()


class CartPole:
    """A toy CartPole: 4 observations, reward 1 a step, done after ``length`` steps."""

    def __init__(self, seed=0):
        self.g = torch.Generator().manual_seed(seed)

    def reset(self, length):
        self.t, self.length = 0, length
        return torch.rand(4, generator=self.g) * 0.1 - 0.05

    def step(self, action):
        self.t += 1
        state = torch.rand(4, generator=self.g) * 0.1 - 0.05 + 0.01 * action
        return state, 1.0, self.t >= self.length


def select_action(policy, state):
    probs = policy(state.float().unsqueeze(0))
    m = Categorical(probs)
    action = m.sample()
    return action.item(), m.log_prob(action)


# --- siamese_network -----------------------------------------------------------------------

class SiameseNetwork(nn.Module):
    """main.py's twin towers (a small conv tower for resnet18), joined by a head and sigmoid."""

    def __init__(self):
        super().__init__()
        self.tower = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
        self.sigmoid = nn.Sigmoid()

    def forward_once(self, x):
        return self.tower(x)

    def forward(self, input1, input2):
        output1 = self.forward_once(input1)
        output2 = self.forward_once(input2)
        output = torch.cat((output1, output2), 1)
        output = self.fc(output)
        return self.sigmoid(output)


def make_siamese() -> nn.Module:
    torch.manual_seed(0)
    return SiameseNetwork()


def pair_batch(i, n=8):
    g = torch.Generator().manual_seed(300 + i)
    x1 = torch.rand(n, 1, 12, 12, generator=g)
    x2 = torch.rand(n, 1, 12, 12, generator=g)
    target = torch.randint(0, 2, (n, 1), generator=g).float()
    return x1, x2, target


# --- super_resolution ----------------------------------------------------------------------

class SRNet(nn.Module):
    """super_resolution/model.py's Net: three convs, a conv to r^2 channels, PixelShuffle."""

    def __init__(self, upscale_factor=2):
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(1, 16, (5, 5), (1, 1), (2, 2))
        self.conv2 = nn.Conv2d(16, 16, (3, 3), (1, 1), (1, 1))
        self.conv3 = nn.Conv2d(16, 8, (3, 3), (1, 1), (1, 1))
        self.conv4 = nn.Conv2d(8, upscale_factor ** 2, (3, 3), (1, 1), (1, 1))
        self.pixel_shuffle = nn.PixelShuffle(upscale_factor)
        self._initialize_weights()

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        x = self.pixel_shuffle(self.conv4(x))
        return x

    def _initialize_weights(self):
        nn.init.orthogonal_(self.conv1.weight, nn.init.calculate_gain("relu"))
        nn.init.orthogonal_(self.conv2.weight, nn.init.calculate_gain("relu"))
        nn.init.orthogonal_(self.conv3.weight, nn.init.calculate_gain("relu"))
        nn.init.orthogonal_(self.conv4.weight)


def make_srnet() -> nn.Module:
    torch.manual_seed(0)
    return SRNet()


def bsds_batch(i, n=4):
    """BSDS300's Y channel: a 16x16 target and its 8x8 downscale (the input)."""
    g = torch.Generator().manual_seed(400 + i)
    target = torch.rand(n, 1, 16, 16, generator=g)
    return F.avg_pool2d(target, 2), target


# --- mnist_forward_forward -----------------------------------------------------------------

class FFLayer(nn.Linear):
    """mnist_forward_forward's Layer: a Linear trained on its own goodness, its own Adam."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 threshold=2.0, lr=0.03):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.relu = torch.nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=lr)
        self.threshold = threshold

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))


def ff_loss(g_pos, g_neg, threshold):
    """The layer's loss, as the example writes it inline: log(1 + exp(...))."""
    return torch.log(1 + torch.exp(torch.cat([-g_pos + threshold, g_neg - threshold]))).mean()


def make_ff_layer(in_features=20, out_features=16, threshold=2.0) -> nn.Module:
    torch.manual_seed(0)
    return FFLayer(in_features, out_features, threshold=threshold)


def overlay_y_on_x(x, y):
    x_ = x.clone()
    x_[:, :10] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_
